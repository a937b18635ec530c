#include "store/auth.hpp"

#include <ferry/core/error.hpp>
#include <ferry/net/protocol.hpp>

#include <openssl/crypto.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

namespace ferry::store::detail {

std::vector<std::uint8_t> random_nonce() {
  std::vector<std::uint8_t> n(net::nonce_size);
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1)
    fail(errc::internal, "store.nonce", "RAND_bytes", "the OpenSSL random generator failed");
  return n;
}

std::vector<std::uint8_t> proof(const std::string& secret, const std::vector<std::uint8_t>& server_nonce,
                                const std::vector<std::uint8_t>& client_nonce) {
  std::vector<std::uint8_t> msg(server_nonce);
  msg.insert(msg.end(), client_nonce.begin(), client_nonce.end());
  std::vector<std::uint8_t> mac(EVP_MAX_MD_SIZE);
  unsigned len = 0;
  if (!HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), msg.data(), msg.size(), mac.data(), &len))
    fail(errc::internal, "store.auth", "HMAC", "HMAC-SHA256 failed");
  mac.resize(len);
  return mac;
}

bool proof_matches(const std::vector<std::uint8_t>& want, const std::vector<std::uint8_t>& got) {
  return want.size() == got.size() && CRYPTO_memcmp(want.data(), got.data(), want.size()) == 0;
}

}  // namespace ferry::store::detail
