#pragma once
// Shared-token authentication (DESIGN.md section 5). The server sends a fresh
// random nonce; the client answers HMAC-SHA256(token, nonce); the server
// recomputes it and compares in constant time. The token never crosses the
// wire. OpenSSL computes everything here; its errors are converted to a
// Status in this file only.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "planner/status.h"

namespace refit::control {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;
inline constexpr size_t kMinTokenBytes = 16;
inline constexpr size_t kMaxTokenBytes = 4096;

using Nonce = std::array<uint8_t, kNonceBytes>;
using Mac = std::array<uint8_t, kMacBytes>;

// A nonce from OpenSSL's CSPRNG.
Result<Nonce> make_nonce();

// HMAC-SHA256(token, message).
Result<Mac> hmac_sha256(const std::string& token, const uint8_t* message, size_t size);

// True when `mac` has kMacBytes bytes equal to `expected`; the time taken
// does not depend on where they differ.
bool mac_equal(const Mac& expected, const std::vector<uint8_t>& mac);

// Reads the token from `path`: one line, surrounding whitespace (a trailing
// newline) removed, between kMinTokenBytes and kMaxTokenBytes long.
Result<std::string> read_token_file(const std::string& path);

}  // namespace refit::control
