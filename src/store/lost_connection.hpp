#pragma once
// The error of a request whose connection was lost under it and that then could not reach its
// server again: the request's own failure, with the reconnection's as its cause. One wording for the
// client's retry and the ferry:// adapter's.
#include <ferry/core/error.hpp>

namespace ferry::store::detail {

inline error lost_and_unreachable(const error& lost, const error& reconnect) {
  return error(error_info{errc::network_error, lost.op(), lost.resource(), "connection lost during the request, and reconnecting failed",
                          reconnect.what(), 0, 0});
}

}  // namespace ferry::store::detail
