#include "transport/control/auth.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <fstream>
#include <sstream>

namespace refit::control {
namespace {

// The one place OpenSSL's error queue becomes a message.
Status openssl_error(const char* what) {
  unsigned long e = ERR_get_error();
  char buf[256] = "no OpenSSL error recorded";
  if (e != 0) ERR_error_string_n(e, buf, sizeof buf);
  ERR_clear_error();
  return Status::internal(std::string("auth: ") + what + " failed: " + buf);
}

}  // namespace

Result<Nonce> make_nonce() {
  Nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) return openssl_error("RAND_bytes");
  return n;
}

Result<Mac> hmac_sha256(const std::string& token, const uint8_t* message, size_t size) {
  Mac mac{};
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), message, size, mac.data(),
           &len) == nullptr ||
      len != mac.size()) {
    return openssl_error("HMAC-SHA256");
  }
  return mac;
}

bool mac_equal(const Mac& expected, const std::vector<uint8_t>& mac) {
  // The length is public (always kMacBytes); only the contents are secret.
  if (mac.size() != expected.size()) return false;
  return CRYPTO_memcmp(expected.data(), mac.data(), expected.size()) == 0;
}

Result<std::string> read_token_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::io_error("auth: cannot open token file \"" + path + "\"");
  std::string text;
  text.resize(kMaxTokenBytes + 2);
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  auto space = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  size_t b = 0, e = text.size();
  while (b < e && space(text[b])) ++b;
  while (e > b && space(text[e - 1])) --e;
  std::string token = text.substr(b, e - b);
  if (token.size() < kMinTokenBytes || token.size() > kMaxTokenBytes) {
    return Status::invalid("auth: token file \"" + path + "\" must hold a token of " +
                           std::to_string(kMinTokenBytes) + " to " + std::to_string(kMaxTokenBytes) +
                           " bytes, got " + (text.size() > kMaxTokenBytes ? "more" :
                           std::to_string(token.size())));
  }
  return token;
}

}  // namespace refit::control
