// Fuzz target: the decoders of what a peer sends before (or beside) any
// batch frame, all of them bytes from the network that nothing has checked
// yet: the stream handshake (common/transport/handshake.h: Hello, Reply and
// their length probes) and the rdma transport's own bytes
// (common/transport/rdma/protocol.h: immediates, control bodies, rdma_cm
// private data). The first input byte picks the decoder; the rest is its
// input.
//
// Properties: no crash or out-of-bounds read (ASan/UBSan); every refusal is
// a kProtocol error with a message; the length probes agree with the
// decoders; what a decoder accepts re-encodes to the same bytes (no field
// silently dropped or normalised).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "common/base/check.h"
#include "common/transport/handshake.h"
#include "common/transport/rdma/protocol.h"

namespace {

namespace hs = ember::transport::handshake;
namespace rp = ember::transport::rdma::protocol;

template <typename T>
void check_refusal(const ember::Result<T>& r) {
  if (r) return;
  EMBER_CHECK(r.error().code() == ember::ErrorCode::kProtocol);
  EMBER_CHECK(!r.error().message().empty());
}

bool same_bytes(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

// Whether re-encoding must give the input back: a Reply of another protocol
// version keeps its status and reserved bytes unchecked (handshake.h), and
// encode() writes zeros there.
bool reencodes_exactly(const hs::Hello&) { return true; }
bool reencodes_exactly(const hs::Reply& r) { return r.version == ember::transport::kProtocolVersion; }

// The length probe (what a reader calls as bytes arrive) and the decoder
// agree: a prefix the probe refuses, or says is short, does not decode; a
// short prefix is told to read at least up to the fixed part.
template <typename Probe, typename Decode>
void stream_message(std::span<const std::byte> in, std::size_t fixed_bytes, Probe probe,
                    Decode decode) {
  auto missing = probe(in);
  check_refusal(missing);
  auto decoded = decode(in);
  check_refusal(decoded);
  if (!missing || *missing != 0) EMBER_CHECK(!decoded);
  if (missing && in.size() < fixed_bytes) EMBER_CHECK(in.size() + *missing >= fixed_bytes);
  if (!decoded) return;
  EMBER_CHECK(missing && *missing == 0);
  if (!reencodes_exactly(*decoded)) return;
  EMBER_CHECK_MSG(same_bytes(hs::encode(*decoded), in), "re-encoding differs ({} bytes in)", in.size());
}

template <typename Body, std::size_t N>
void control_body(std::span<const std::byte> in, ember::Result<Body> (*decode)(std::span<const std::byte>)) {
  auto body = decode(in);
  check_refusal(body);
  if (!body) return;
  EMBER_CHECK(in.size() == N);
  std::byte out[N];
  rp::encode(*body, std::span<std::byte, N>(out));
  EMBER_CHECK_MSG(same_bytes(out, in), "re-encoding a {}-byte control body differs", N);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data) + 1, size - 1);
  switch (data[0] % 9) {
    case 0:
      stream_message(in, hs::kHelloFixedBytes, hs::hello_bytes_missing, hs::decode_hello);
      break;
    case 1:
      stream_message(in, hs::kReplyFixedBytes, hs::reply_bytes_missing, hs::decode_reply);
      break;
    case 2:
      control_body<rp::RtsBody, rp::kRtsBytes>(in, rp::decode_rts);
      break;
    case 3:
      control_body<rp::GrantBody, rp::kGrantBytes>(in, rp::decode_grant);
      break;
    case 4:
      control_body<rp::NoGrantBody, rp::kNoGrantBytes>(in, rp::decode_no_grant);
      break;
    case 5:
      control_body<rp::ReleaseBody, rp::kReleaseBytes>(in, rp::decode_release);
      break;
    case 6: {
      // Connect private data: the Hello's fixed part (no token), the token
      // digest, then CM padding. Re-encoding gives the first 48 bytes back
      // when the digest is the one of an empty token.
      auto d = rp::decode_connect_data(in);
      check_refusal(d);
      if (!d) break;
      EMBER_CHECK(in.size() >= rp::kConnectDataBytes);
      EMBER_CHECK(d->hello.token.empty());
      std::vector<std::byte> again = rp::encode_connect_data(d->hello);
      EMBER_CHECK(again.size() == rp::kConnectDataBytes);
      EMBER_CHECK(same_bytes(std::span(again).first(hs::kHelloFixedBytes), in.first(hs::kHelloFixedBytes)));
      break;
    }
    case 7: {
      // Accept/reject private data: a Reply, then CM padding.
      auto r = rp::decode_reply_data(in);
      check_refusal(r);
      if (!r || !reencodes_exactly(*r)) break;
      const std::vector<std::byte> again = rp::encode_reply_data(*r, in.size());
      EMBER_CHECK(again.size() <= in.size());
      EMBER_CHECK_MSG(same_bytes(again, in.first(again.size())), "re-encoding reply data differs");
      break;
    }
    case 8: {
      // Immediates: unpack then pack is the identity on every known type.
      std::uint32_t imm = 0;
      std::memcpy(&imm, in.data(), in.size() < 4 ? in.size() : 4);
      if (const auto u = rp::unpack_imm(imm)) {
        EMBER_CHECK(rp::pack_imm(u->type, u->credits) == imm);
        EMBER_CHECK(!rp::msg_type_name(u->type).empty());
      }
      break;
    }
  }
  return 0;
}
