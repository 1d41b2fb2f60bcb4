#pragma once
// Authentication of the control plane (docs/security.md, "Control plane").
//
// Secrets. The coordinator holds the token (a file of 16 to 4096 bytes).
// Each role has a key derived from it, HMAC-SHA256(token, "refit role key
// v1: " + role), for the roles "source", "receiver" and "any" (every
// request; what a holder of the token itself uses). A member can be given
// the token, or only its role's key, as a file holding
// "refit-source-key:<64 hex digits>" (`refit-coordinator --print-role-key`
// writes it): a receiver that holds only the receiver key cannot pass for a
// source or for the coordinator of sources.
//
// Handshake, mutual. The server sends nonce_s. The client answers with the
// role it claims, its own nonce_c and HMAC(K_role, "refit client proof v1" |
// role | nonce_s | nonce_c); the server checks it in constant time and
// proves in turn that it holds K_role with HMAC(K_role, "refit server proof
// v1" | role | nonce_s | nonce_c), which the client checks. Both then derive
// one key per direction from K_role and both nonces; every later frame
// carries an HMAC under its direction's key over an implicit sequence number
// and the whole frame (frame_codec.h's FrameSealer and FrameDecoder), so a
// frame altered, injected, dropped or replayed fails its check. No secret
// crosses the wire. OpenSSL computes everything here; its errors become a
// Status in this file only.

#include <array>
#include <cstdint>
#include <optional>
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

// The role a connection authenticates as; it bounds what it may send.
enum class AuthRole : uint8_t { kAny, kSource, kReceiver };
const char* auth_role_name(AuthRole r);
std::optional<AuthRole> auth_role_from(const std::string& name);

// A nonce from OpenSSL's CSPRNG.
Result<Nonce> make_nonce();

// HMAC-SHA256(token, message).
Result<Mac> hmac_sha256(const std::string& token, const uint8_t* message, size_t size);

// HMAC-SHA256 over several pieces, for the frames' seals.
class Hmac {
 public:
  explicit Hmac(const Mac& key);
  ~Hmac();
  Hmac(const Hmac&) = delete;
  Hmac& operator=(const Hmac&) = delete;
  // Starts a new MAC under the key; then update() the pieces, then finish().
  Status begin();
  Status update(const uint8_t* data, size_t size);
  Result<Mac> finish();

 private:
  Mac key_;
  struct State;
  State* state_ = nullptr;
};

// True when `mac` has kMacBytes bytes equal to `expected`; the time taken
// does not depend on where they differ.
bool mac_equal(const Mac& expected, const std::vector<uint8_t>& mac);
// The same for kMacBytes bytes at `mac`.
bool mac_equal_bytes(const Mac& expected, const uint8_t* mac);

// Reads the token from `path`: one line, surrounding whitespace (a trailing
// newline) removed, between kMinTokenBytes and kMaxTokenBytes long. A file
// that group or others may read or write is refused, as ssh refuses such
// private keys.
Result<std::string> read_token_file(const std::string& path);

// What a member authenticates with: the token (any role may be claimed) or
// one role's key (only that role).
struct Credential {
  std::optional<AuthRole> bound;  // set: a role key, for this role only
  std::string token;              // unset bound: the token
  Mac key{};                      // set bound: the role's key
  // The key for `role`; fails when the credential is bound to another role.
  Result<Mac> key_for(AuthRole role) const;
};
// A token file, or a role key file ("refit-<role>-key:<hex>"), checked as
// read_token_file checks.
Result<Credential> read_credential_file(const std::string& path);
Credential credential_from_token(std::string token);
// K_role (above).
Result<Mac> role_key(const std::string& token, AuthRole role);
// The text of a role key file: "refit-receiver-key:<64 hex digits>".
std::string role_key_text(AuthRole role, const Mac& key);

// The handshake's proofs and the session's keys (above).
Result<Mac> client_proof(const Mac& role_key, AuthRole role, const Nonce& server, const Nonce& client);
Result<Mac> server_proof(const Mac& role_key, AuthRole role, const Nonce& server, const Nonce& client);
struct SessionKeys {
  Mac client_to_server{};
  Mac server_to_client{};
};
Result<SessionKeys> session_keys(const Mac& role_key, AuthRole role, const Nonce& server, const Nonce& client);

}  // namespace refit::control
