#include "transport/control/auth.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include <cerrno>
#include <cstring>

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

Result<Mac> mac_of(const Mac& key, const std::string& label, AuthRole role, const Nonce& server,
                   const Nonce& client) {
  Hmac h(key);
  REFIT_RETURN_IF_ERROR(h.begin());
  const std::string head = label + " " + auth_role_name(role);
  const uint8_t zero = 0;
  REFIT_RETURN_IF_ERROR(h.update(reinterpret_cast<const uint8_t*>(head.data()), head.size()));
  REFIT_RETURN_IF_ERROR(h.update(&zero, 1));
  REFIT_RETURN_IF_ERROR(h.update(server.data(), server.size()));
  REFIT_RETURN_IF_ERROR(h.update(client.data(), client.size()));
  return h.finish();
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

const char* auth_role_name(AuthRole r) {
  switch (r) {
    case AuthRole::kSource: return "source";
    case AuthRole::kReceiver: return "receiver";
    case AuthRole::kAny: return "any";
  }
  return "any";
}

std::optional<AuthRole> auth_role_from(const std::string& name) {
  if (name == "source") return AuthRole::kSource;
  if (name == "receiver") return AuthRole::kReceiver;
  if (name == "any") return AuthRole::kAny;
  return std::nullopt;
}

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

struct Hmac::State {
  EVP_MAC* mac = nullptr;
  EVP_MAC_CTX* ctx = nullptr;
};

Hmac::Hmac(const Mac& key) : key_(key) {}

Hmac::~Hmac() {
  if (state_ != nullptr) {
    EVP_MAC_CTX_free(state_->ctx);
    EVP_MAC_free(state_->mac);
    delete state_;
  }
  OPENSSL_cleanse(key_.data(), key_.size());
}

Status Hmac::begin() {
  if (state_ == nullptr) {
    state_ = new State;
    state_->mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
    if (state_->mac == nullptr) return openssl_error("EVP_MAC_fetch(HMAC)");
    state_->ctx = EVP_MAC_CTX_new(state_->mac);
    if (state_->ctx == nullptr) return openssl_error("EVP_MAC_CTX_new");
  }
  if (state_->ctx == nullptr) return Status::internal("auth: HMAC state unusable");
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_construct_end()};
  if (EVP_MAC_init(state_->ctx, key_.data(), key_.size(), params) != 1) return openssl_error("EVP_MAC_init");
  return Status::ok();
}

Status Hmac::update(const uint8_t* data, size_t size) {
  if (size == 0) return Status::ok();
  if (state_ == nullptr || EVP_MAC_update(state_->ctx, data, size) != 1) return openssl_error("EVP_MAC_update");
  return Status::ok();
}

Result<Mac> Hmac::finish() {
  Mac out{};
  size_t len = 0;
  if (state_ == nullptr || EVP_MAC_final(state_->ctx, out.data(), &len, out.size()) != 1 || len != out.size()) {
    return openssl_error("EVP_MAC_final");
  }
  return out;
}

bool mac_equal(const Mac& expected, const std::vector<uint8_t>& mac) {
  // The length is public (always kMacBytes); only the contents are secret.
  if (mac.size() != expected.size()) return false;
  return CRYPTO_memcmp(expected.data(), mac.data(), expected.size()) == 0;
}

bool mac_equal_bytes(const Mac& expected, const uint8_t* mac) {
  return CRYPTO_memcmp(expected.data(), mac, expected.size()) == 0;
}

Result<std::string> read_token_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::io_error("auth: cannot open token file \"" + path + "\": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::invalid("auth: token file \"" + path + "\" is not a regular file");
  }
  if ((st.st_mode & 077) != 0) {
    ::close(fd);
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return Status::invalid("auth: token file \"" + path + "\" has mode " + mode +
                           ": group or others may access it; make it private (chmod 600), as ssh requires of keys");
  }
  std::string text(kMaxTokenBytes + 2, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  text.resize(got);
  auto space = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  size_t b = 0, e = text.size();
  while (b < e && space(text[b])) ++b;
  while (e > b && space(text[e - 1])) --e;
  std::string token = text.substr(b, e - b);
  OPENSSL_cleanse(text.data(), text.size());
  if (token.size() < kMinTokenBytes || token.size() > kMaxTokenBytes) {
    return Status::invalid("auth: token file \"" + path + "\" must hold a token of " +
                           std::to_string(kMinTokenBytes) + " to " + std::to_string(kMaxTokenBytes) +
                           " bytes, got " + (got > kMaxTokenBytes ? "more" : std::to_string(token.size())));
  }
  return token;
}

Result<Mac> role_key(const std::string& token, AuthRole role) {
  const std::string label = std::string("refit role key v1: ") + auth_role_name(role);
  return hmac_sha256(token, reinterpret_cast<const uint8_t*>(label.data()), label.size());
}

std::string role_key_text(AuthRole role, const Mac& key) {
  static const char kHex[] = "0123456789abcdef";
  std::string out = std::string("refit-") + auth_role_name(role) + "-key:";
  for (uint8_t b : key) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

Result<Mac> Credential::key_for(AuthRole role) const {
  if (bound) {
    if (*bound != role) {
      return Status::invalid(std::string("auth: the credential is the ") + auth_role_name(*bound) +
                             " key; it cannot authenticate as a " + auth_role_name(role));
    }
    return key;
  }
  return role_key(token, role);
}

Credential credential_from_token(std::string token) {
  Credential c;
  c.token = std::move(token);
  return c;
}

Result<Credential> read_credential_file(const std::string& path) {
  Result<std::string> text = read_token_file(path);
  if (!text.is_ok()) return text.status();
  for (AuthRole role : {AuthRole::kSource, AuthRole::kReceiver, AuthRole::kAny}) {
    const std::string prefix = std::string("refit-") + auth_role_name(role) + "-key:";
    if (text->rfind(prefix, 0) != 0) continue;
    const std::string hex = text->substr(prefix.size());
    Credential c;
    c.bound = role;
    bool ok = hex.size() == 2 * kMacBytes;
    for (size_t i = 0; ok && i < kMacBytes; ++i) {
      const int hi = hex_digit(hex[2 * i]), lo = hex_digit(hex[2 * i + 1]);
      ok = hi >= 0 && lo >= 0;
      if (ok) c.key[i] = static_cast<uint8_t>(hi << 4 | lo);
    }
    if (!ok) {
      return Status::invalid("auth: key file \"" + path + "\" must hold \"" + prefix + "\" and 64 hex digits");
    }
    return c;
  }
  return credential_from_token(std::move(text).value());
}

Result<Mac> client_proof(const Mac& key, AuthRole role, const Nonce& server, const Nonce& client) {
  return mac_of(key, "refit client proof v1", role, server, client);
}

Result<Mac> server_proof(const Mac& key, AuthRole role, const Nonce& server, const Nonce& client) {
  return mac_of(key, "refit server proof v1", role, server, client);
}

Result<SessionKeys> session_keys(const Mac& key, AuthRole role, const Nonce& server, const Nonce& client) {
  Result<Mac> c2s = mac_of(key, "refit client-to-server key v1", role, server, client);
  if (!c2s.is_ok()) return c2s.status();
  Result<Mac> s2c = mac_of(key, "refit server-to-client key v1", role, server, client);
  if (!s2c.is_ok()) return s2c.status();
  return SessionKeys{*c2s, *s2c};
}

}  // namespace refit::control
