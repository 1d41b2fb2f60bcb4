#include "transport/control/auth.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sys/stat.h>
#include <unistd.h>

namespace refit::control {
namespace {

TEST(Auth, HmacMatchesRfc4231Case2) {
  const std::string key = "Jefe";
  const std::string msg = "what do ya want for nothing?";
  auto mac = hmac_sha256(key, reinterpret_cast<const uint8_t*>(msg.data()), msg.size());
  ASSERT_TRUE(mac.is_ok());
  char hex[65];
  for (size_t i = 0; i < 32; ++i) std::snprintf(hex + 2 * i, 3, "%02x", (*mac)[i]);
  EXPECT_EQ(std::string(hex), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(Auth, NoncesDiffer) {
  auto a = make_nonce();
  auto b = make_nonce();
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_NE(*a, *b);
}

TEST(Auth, MacEqualChecksLengthAndContents) {
  Mac m{};
  m[5] = 7;
  std::vector<uint8_t> same(m.begin(), m.end());
  EXPECT_TRUE(mac_equal(m, same));
  same[31] ^= 1;
  EXPECT_FALSE(mac_equal(m, same));
  EXPECT_FALSE(mac_equal(m, std::vector<uint8_t>(m.begin(), m.begin() + 31)));
  EXPECT_FALSE(mac_equal(m, {}));
}

std::string temp_file(const std::string& text) {
  char path[] = "/tmp/refit_token_XXXXXX";
  int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  close(fd);
  return path;
}

TEST(Auth, ReadsTokenFileWithoutTrailingNewline) {
  std::string p = temp_file("0123456789abcdef-secret\n");
  auto t = read_token_file(p);
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  EXPECT_EQ(*t, "0123456789abcdef-secret");
  unlink(p.c_str());
}

TEST(Auth, RefusesShortMissingAndHugeTokens) {
  std::string p = temp_file("short\n");
  auto t = read_token_file(p);
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("got 5"), std::string::npos) << t.status().message();
  unlink(p.c_str());
  EXPECT_FALSE(read_token_file("/nonexistent/refit-token").is_ok());
  p = temp_file(std::string(10000, 'x'));
  EXPECT_FALSE(read_token_file(p).is_ok());
  unlink(p.c_str());
}

TEST(Auth, RefusesATokenFileOthersMayRead) {
  std::string p = temp_file("0123456789abcdef-secret\n");
  ASSERT_EQ(chmod(p.c_str(), 0644), 0);
  auto t = read_token_file(p);
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("has mode 0644: group or others may access it"), std::string::npos)
      << t.status().message();
  ASSERT_EQ(chmod(p.c_str(), 0640), 0);
  EXPECT_FALSE(read_token_file(p).is_ok());
  ASSERT_EQ(chmod(p.c_str(), 0600), 0);
  EXPECT_TRUE(read_token_file(p).is_ok());
  ASSERT_EQ(chmod(p.c_str(), 0400), 0);
  EXPECT_TRUE(read_token_file(p).is_ok());
  unlink(p.c_str());
}

TEST(Auth, RoleKeysDifferAndBindTheirRole) {
  const std::string token = "0123456789abcdef-secret";
  auto source = role_key(token, AuthRole::kSource);
  auto receiver = role_key(token, AuthRole::kReceiver);
  ASSERT_TRUE(source.is_ok() && receiver.is_ok());
  EXPECT_NE(*source, *receiver);
  // A receiver key file: only the receiver role.
  std::string p = temp_file(role_key_text(AuthRole::kReceiver, *receiver) + "\n");
  auto c = read_credential_file(p);
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  ASSERT_TRUE(c->bound.has_value());
  EXPECT_EQ(*c->bound, AuthRole::kReceiver);
  auto k = c->key_for(AuthRole::kReceiver);
  ASSERT_TRUE(k.is_ok());
  EXPECT_EQ(*k, *receiver);
  auto as_source = c->key_for(AuthRole::kSource);
  ASSERT_FALSE(as_source.is_ok());
  EXPECT_NE(as_source.status().message().find("the credential is the receiver key; it cannot authenticate as a source"),
            std::string::npos);
  unlink(p.c_str());
  // The token: every role, each with its own key.
  Credential t = credential_from_token(token);
  EXPECT_EQ(*t.key_for(AuthRole::kSource), *source);
  EXPECT_EQ(*t.key_for(AuthRole::kReceiver), *receiver);
  // A malformed key file names the problem.
  p = temp_file("refit-source-key:12zz\n");
  auto bad = read_credential_file(p);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("must hold \"refit-source-key:\" and 64 hex digits"), std::string::npos);
  unlink(p.c_str());
}

TEST(Auth, ProofsAndSessionKeysDependOnRoleNoncesAndDirection) {
  const Mac key = *role_key("0123456789abcdef-secret", AuthRole::kSource);
  Nonce s{}, c{};
  s[0] = 1;
  c[0] = 2;
  auto client = client_proof(key, AuthRole::kSource, s, c);
  auto server = server_proof(key, AuthRole::kSource, s, c);
  ASSERT_TRUE(client.is_ok() && server.is_ok());
  EXPECT_NE(*client, *server) << "the server's proof cannot be the client's echoed";
  EXPECT_NE(*client, *client_proof(key, AuthRole::kReceiver, s, c));
  Nonce c2 = c;
  c2[31] = 9;
  EXPECT_NE(*client, *client_proof(key, AuthRole::kSource, s, c2));
  auto keys = session_keys(key, AuthRole::kSource, s, c);
  ASSERT_TRUE(keys.is_ok());
  EXPECT_NE(keys->client_to_server, keys->server_to_client);
}

}  // namespace
}  // namespace refit::control
