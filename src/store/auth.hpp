#pragma once
// Shared-secret challenge-response (HMAC-SHA256 through Debian's OpenSSL), used by both ends.
#include <cstdint>
#include <string>
#include <vector>

namespace ferry::store::detail {

std::vector<std::uint8_t> random_nonce();
// HMAC-SHA256(secret, server nonce | client nonce).
std::vector<std::uint8_t> proof(const std::string& secret, const std::vector<std::uint8_t>& server_nonce,
                                const std::vector<std::uint8_t>& client_nonce);
// Constant-time comparison of a received proof with the expected one.
bool proof_matches(const std::vector<std::uint8_t>& want, const std::vector<std::uint8_t>& got);

}  // namespace ferry::store::detail
