#include "transport/control/auth.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
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

}  // namespace
}  // namespace refit::control
