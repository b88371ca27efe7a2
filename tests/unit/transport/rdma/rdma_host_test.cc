// rdma tests that need no RDMA device (label unit; run in every build): the
// protocol encoders and decoders, the memlock check, the transport = "auto"
// policy, and the clear errors of transport = "rdma" on a host without a
// device.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include "common/config/config.h"
#include "common/transport/handshake.h"
#include "common/transport/options_from_config.h"
#include "common/transport/rdma/device.h"
#include "common/transport/rdma/memlock.h"
#include "common/transport/rdma/protocol.h"
#include "common/transport/rdma/rdma_transport.h"
#include "common/transport/transport.h"
#include "tests/unit/transport/rdma/rdma_test_util.h"

namespace ember::transport::rdma {
namespace {

using protocol::MsgType;

// --- protocol ---

TEST(RdmaProtocol, ImmediatesCarryTypeAndCredits) {
  for (std::uint8_t t = 1; t <= protocol::kMaxMsgType; ++t) {
    for (std::uint32_t credits : {0u, 1u, 60u, protocol::kMaxImmCredits}) {
      const auto imm = protocol::pack_imm(static_cast<MsgType>(t), credits);
      const auto back = protocol::unpack_imm(imm);
      ASSERT_TRUE(back.has_value());
      EXPECT_EQ(static_cast<std::uint8_t>(back->type), t);
      EXPECT_EQ(back->credits, credits);
    }
  }
  EXPECT_FALSE(protocol::unpack_imm(0).has_value()) << "type 0 is not a message";
  EXPECT_FALSE(protocol::unpack_imm(std::uint32_t{protocol::kMaxMsgType + 1} << 24).has_value());
  EXPECT_FALSE(protocol::unpack_imm(0xFF000000u).has_value());
}

TEST(RdmaProtocol, ControlBodiesRoundTrip) {
  std::array<std::byte, protocol::kRtsBytes> rts;
  protocol::encode(protocol::RtsBody{(64u << 20) + 3, 77}, rts);
  auto r = protocol::decode_rts(rts);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->size_bytes, (64u << 20) + 3);
  EXPECT_EQ(r->request, 77u);

  std::array<std::byte, protocol::kGrantBytes> grant;
  protocol::encode(protocol::GrantBody{0x7f0012345000ull, 1u << 20, 0xdeadbeef, 9, 77}, grant);
  auto g = protocol::decode_grant(grant);
  ASSERT_TRUE(g);
  EXPECT_EQ(g->address, 0x7f0012345000ull);
  EXPECT_EQ(g->capacity_bytes, 1u << 20);
  EXPECT_EQ(g->rkey, 0xdeadbeefu);
  EXPECT_EQ(g->slot, 9u);
  EXPECT_EQ(g->request, 77u);

  std::array<std::byte, protocol::kNoGrantBytes> ng;
  protocol::encode(protocol::NoGrantBody{5}, ng);
  ASSERT_TRUE(protocol::decode_no_grant(ng));
  EXPECT_EQ(protocol::decode_no_grant(ng)->request, 5u);

  std::array<std::byte, protocol::kReleaseBytes> rel;
  protocol::encode(protocol::ReleaseBody{12}, rel);
  ASSERT_TRUE(protocol::decode_release(rel));
  EXPECT_EQ(protocol::decode_release(rel)->slot, 12u);
}

TEST(RdmaProtocol, MalformedControlBodiesAreProtocolErrors) {
  std::array<std::byte, protocol::kGrantBytes> grant;
  protocol::encode(protocol::GrantBody{0x1000, 4096, 1, 3, 0}, grant);
  // Wrong size.
  auto short_grant = protocol::decode_grant(std::span<const std::byte>(grant).first(31));
  ASSERT_FALSE(short_grant);
  EXPECT_EQ(short_grant.error().code(), ErrorCode::kProtocol);
  // Reserved bytes must be zero.
  auto dirty = grant;
  dirty[30] = std::byte{1};
  EXPECT_FALSE(protocol::decode_grant(dirty));
  // Slot 0 and zero capacity are never granted.
  protocol::encode(protocol::GrantBody{0x1000, 4096, 1, 0, 0}, grant);
  EXPECT_FALSE(protocol::decode_grant(grant));
  protocol::encode(protocol::GrantBody{0x1000, 0, 1, 3, 0}, grant);
  EXPECT_FALSE(protocol::decode_grant(grant));
  std::array<std::byte, protocol::kRtsBytes> rts;
  protocol::encode(protocol::RtsBody{100, 0}, rts);
  EXPECT_FALSE(protocol::decode_rts(rts)) << "request 0 is reserved for unsolicited grants";
  std::array<std::byte, protocol::kReleaseBytes> rel;
  protocol::encode(protocol::ReleaseBody{0}, rel);
  EXPECT_FALSE(protocol::decode_release(rel));
  std::array<std::byte, protocol::kNoGrantBytes> ng;
  protocol::encode(protocol::NoGrantBody{0}, ng);
  EXPECT_FALSE(protocol::decode_no_grant(ng));
}

handshake::Hello sample_hello() {
  handshake::Hello h;
  h.role = Role::kWorker;
  h.kind = Kind::kRdma;
  h.rank = 17;
  h.num_channels = 4;
  h.channel = 3;
  h.session_id = 0x0123456789abcdefull;
  h.max_message_bytes = 1u << 30;
  h.token = "a secret that is longer than the private data itself";
  return h;
}

TEST(RdmaProtocol, ConnectDataFitsTheCmAndRoundTripsThroughItsPadding) {
  const handshake::Hello h = sample_hello();
  std::vector<std::byte> data = protocol::encode_connect_data(h);
  ASSERT_EQ(data.size(), protocol::kConnectDataBytes);
  ASSERT_LE(data.size(), protocol::kMaxConnectDataBytes);
  const std::string text(reinterpret_cast<const char*>(data.data()), data.size());
  EXPECT_EQ(text.find("secret"), std::string::npos) << "the token itself is not sent";
  data.resize(protocol::kMaxConnectDataBytes);  // the CM pads private data with zeros
  auto d = protocol::decode_connect_data(data);
  ASSERT_TRUE(d) << d.error().to_string();
  EXPECT_EQ(d->hello.role, h.role);
  EXPECT_EQ(d->hello.kind, Kind::kRdma);
  EXPECT_EQ(d->hello.rank, h.rank);
  EXPECT_EQ(d->hello.num_channels, h.num_channels);
  EXPECT_EQ(d->hello.channel, h.channel);
  EXPECT_EQ(d->hello.session_id, h.session_id);
  EXPECT_EQ(d->hello.max_message_bytes, h.max_message_bytes);
  EXPECT_TRUE(d->hello.token.empty());
  EXPECT_EQ(d->token_digest, protocol::token_digest(h.token, h.session_id));
}

TEST(RdmaProtocol, ConnectDataFromANonEmberPeerIsRefused) {
  std::vector<std::byte> garbage(56, std::byte{0x5a});
  auto g = protocol::decode_connect_data(garbage);
  ASSERT_FALSE(g);
  EXPECT_EQ(g.error().code(), ErrorCode::kProtocol);
  auto empty = protocol::decode_connect_data({});
  ASSERT_FALSE(empty);
  EXPECT_NE(empty.error().message().find("not an Ember worker"), std::string::npos);
  std::vector<std::byte> data = protocol::encode_connect_data(sample_hello());
  data.resize(40);  // digest cut off
  EXPECT_FALSE(protocol::decode_connect_data(data));
}

TEST(RdmaProtocol, TokenDigestDependsOnTokenAndSession) {
  const auto a = protocol::token_digest("token", 1);
  EXPECT_EQ(a, protocol::token_digest("token", 1));
  EXPECT_NE(a, protocol::token_digest("token", 2));
  EXPECT_NE(a, protocol::token_digest("tokeN", 1));
  EXPECT_NE(a, protocol::token_digest("", 1));
}

TEST(RdmaProtocol, ReplyIsCutToFitARejectAndSurvivesPadding) {
  handshake::Reply r;
  r.status = ErrorCode::kAuth;
  r.role = Role::kServer;
  r.rank = 2;
  r.num_channels = 4;
  // 200 bytes of text, with a 2-byte UTF-8 character straddling the cut.
  r.text = std::string(123, 'x') + "\xc3\xa9" + std::string(75, 'y');
  std::vector<std::byte> data = protocol::encode_reply_data(r, protocol::kMaxRejectDataBytes);
  EXPECT_LE(data.size(), protocol::kMaxRejectDataBytes);
  data.resize(protocol::kMaxRejectDataBytes);  // padded
  auto back = protocol::decode_reply_data(data);
  ASSERT_TRUE(back) << back.error().to_string();
  EXPECT_EQ(back->status, ErrorCode::kAuth);
  EXPECT_EQ(back->rank, 2u);
  EXPECT_EQ(back->num_channels, 4u);
  EXPECT_EQ(back->text, std::string(123, 'x')) << "cut before the character, not inside it";
  EXPECT_FALSE(protocol::decode_reply_data(std::vector<std::byte>(10)));
}

// --- memlock ---

TEST(RdmaMemlock, TooSmallLimitNamesTheLimitTheNeedAndHowToRaiseIt) {
  MemlockLimit l;
  l.soft_bytes = 64u << 10;
  l.hard_bytes = 64u << 10;
  l.pinned_bytes = 0;
  auto s = check_memlock(128u << 20, "the page pool 'pool' of 128 MiB", l);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kConfig);
  const std::string m = s.error().message();
  EXPECT_NE(m.find("RLIMIT_MEMLOCK"), std::string::npos) << m;
  EXPECT_NE(m.find("64 KiB"), std::string::npos) << "the limit: " << m;
  EXPECT_NE(m.find("128 MiB"), std::string::npos) << "the need: " << m;
  EXPECT_NE(m.find("LimitMEMLOCK="), std::string::npos) << m;
  EXPECT_NE(m.find("ulimit -l"), std::string::npos) << m;
  EXPECT_NE(m.find("ulimit -l 131072"), std::string::npos) << "KiB for ulimit: " << m;
  EXPECT_NE(m.find("hard limit"), std::string::npos) << "the hard limit is too small too: " << m;
}

TEST(RdmaMemlock, AlreadyPinnedMemoryCounts) {
  MemlockLimit l;
  l.soft_bytes = 100u << 20;
  l.hard_bytes = l.soft_bytes;
  l.pinned_bytes = 60u << 20;
  EXPECT_TRUE(check_memlock(40u << 20, "x", l));
  EXPECT_FALSE(check_memlock((40u << 20) + 1, "x", l));
}

TEST(RdmaMemlock, UnlimitedOrCapIpcLockPasses) {
  MemlockLimit l;
  l.soft_bytes = 0;
  l.unlimited = true;
  EXPECT_TRUE(check_memlock(std::uint64_t{1} << 40, "x", l));
  l.unlimited = false;
  l.cap_ipc_lock = true;
  EXPECT_TRUE(check_memlock(std::uint64_t{1} << 40, "x", l));
}

TEST(RdmaMemlock, ReadsAndAppliesTheProcessLimit) {
  rlimit rl{};
  ASSERT_EQ(::getrlimit(RLIMIT_MEMLOCK, &rl), 0);
  if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < (8u << 20)) {
    GTEST_SKIP() << "the hard RLIMIT_MEMLOCK is below 8 MiB here";
  }
  testing::ScopedMemlockLimit lowered(8u << 20);
  auto l = read_memlock_limit();
  ASSERT_TRUE(l) << l.error().to_string();
  EXPECT_FALSE(l->unlimited);
  EXPECT_EQ(l->soft_bytes, 8u << 20);
  EXPECT_FALSE(l->cap_ipc_lock) << "dropped for this thread";
  auto s = check_memlock(64u << 20, "a 64 MiB test region");
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kConfig);
  EXPECT_TRUE(check_memlock(64u << 10, "a 64 KiB test region"));
}

// --- transport = "auto" and "rdma" ---

// Device lists as probe_devices() reports them, injected into the policy.
PortInfo port(std::uint8_t num, bool active, std::string netdev = "d0",
              std::vector<std::string> ipv4 = {"198.18.0.1"}) {
  PortInfo p;
  p.port_num = num;
  p.active = active;
  p.state = active ? "ACTIVE" : "DOWN";
  p.link_layer = "Ethernet";
  p.netdev = std::move(netdev);
  p.ipv4 = std::move(ipv4);
  return p;
}
DeviceInfo device(std::string name, std::vector<PortInfo> ports) {
  DeviceInfo d;
  d.name = std::move(name);
  d.ports = std::move(ports);
  return d;
}
bool has(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}

TEST(RdmaSelect, AvailabilityIsTheFirstActivePortOrSaysWhyNone) {
  const Availability none = availability_of({});
  EXPECT_FALSE(none.available);
  EXPECT_TRUE(has(none.detail, "no RDMA device (ibv_get_device_list found none")) << none.detail;

  const std::vector<DeviceInfo> down = {device("mlx5_0", {port(1, false, "", {})}),
                                        device("rxe9", {})};
  const Availability d = availability_of(down);
  EXPECT_FALSE(d.available);
  EXPECT_EQ(d.detail,
            "no RDMA device has an active port: mlx5_0 port 1 (DOWN, Ethernet); rxe9 (cannot be "
            "opened)");

  const std::vector<DeviceInfo> mixed = {device("mlx5_0", {port(1, false), port(2, true, "eth1", {"10.1.0.5"})}),
                                         device("rxe0", {port(1, true)})};
  const Availability a = availability_of(mixed);
  ASSERT_TRUE(a.available);
  EXPECT_EQ(a.device, "mlx5_0");
  EXPECT_EQ(a.port_num, 2);
  EXPECT_EQ(a.address, "10.1.0.5");
  EXPECT_EQ(a.detail, "mlx5_0 port 2 (ACTIVE, Ethernet, netdev eth1, 10.1.0.5)");
}

TEST(RdmaSelect, AnActivePortMeansRdmaForARemotePeerButShmForOneOnThisHost) {
  const std::vector<DeviceInfo> devices = {device("rxe0", {port(1, true)})};
  const AutoChoice remote = choose_auto(/*peer_on_same_host=*/false, devices);
  EXPECT_EQ(remote.kind, Kind::kRdma);
  EXPECT_EQ(remote.reason,
            "transport = \"auto\": using rdma: rxe0 port 1 (ACTIVE, Ethernet, netdev d0, 198.18.0.1)");
  // A same-host peer is at a loopback address, which no RDMA port reaches:
  // shm, and the line says rdma is there for other hosts.
  const AutoChoice local = choose_auto(/*peer_on_same_host=*/true, devices);
  EXPECT_EQ(local.kind, Kind::kShm);
  EXPECT_TRUE(has(local.reason, "using shm (the peer is on this host, at a loopback address"))
      << local.reason;
  EXPECT_TRUE(has(local.reason, "rdma is available (rxe0 port 1")) << local.reason;
}

TEST(RdmaSelect, WithoutAnActivePortASameHostPeerGetsShmAndARemoteOneTcp) {
  for (const std::vector<DeviceInfo>& devices :
       {std::vector<DeviceInfo>{}, std::vector<DeviceInfo>{device("rxe0", {port(1, false)})}}) {
    const std::string why_not = availability_of(devices).detail;
    const AutoChoice local = choose_auto(/*peer_on_same_host=*/true, devices);
    EXPECT_EQ(local.kind, Kind::kShm);
    EXPECT_TRUE(has(local.reason, "transport = \"auto\": using shm (the peer is on this host"))
        << local.reason;
    EXPECT_TRUE(local.reason.ends_with("; not rdma: " + why_not)) << local.reason;
    const AutoChoice remote = choose_auto(/*peer_on_same_host=*/false, devices);
    EXPECT_EQ(remote.kind, Kind::kTcp);
    EXPECT_EQ(remote.reason,
              "transport = \"auto\": using tcp (the peer is on another host); not rdma: " + why_not);
  }
}

TEST(RdmaSelect, ASameHostPeerGetsTcpWhenTheBuildHasNoShm) {
  const std::vector<DeviceInfo> devices = {device("rxe0", {port(1, false)})};
  const AutoChoice c = choose_auto(/*peer_on_same_host=*/true, devices, /*shm_built=*/false);
  EXPECT_EQ(c.kind, Kind::kTcp);
  EXPECT_TRUE(has(c.reason, "using tcp (the peer is on this host but this build has no shm)"))
      << c.reason;
  // Without shm an active port wins, and the line says which address to use.
  const std::vector<DeviceInfo> up = {device("rxe0", {port(1, true)})};
  const AutoChoice rdma = choose_auto(true, up, false);
  EXPECT_EQ(rdma.kind, Kind::kRdma);
  EXPECT_TRUE(has(rdma.reason, "not 127.0.0.1")) << rdma.reason;
}

TEST(RdmaSelect, ABuildWithoutRdmaFallsBackAndSaysSo) {
  Availability not_built;  // what probe_rdma() returns with EMBER_WITH_RDMA=OFF
  not_built.detail = "this build has no rdma transport (EMBER_WITH_RDMA=OFF: ...)";
  EXPECT_EQ(choose_auto(true, not_built).kind, Kind::kShm);
  const AutoChoice remote = choose_auto(false, not_built);
  EXPECT_EQ(remote.kind, Kind::kTcp);
  EXPECT_TRUE(has(remote.reason, "EMBER_WITH_RDMA=OFF")) << remote.reason;
}

TEST(RdmaHost, ProbeAgreesWithItself) {
  const auto devices = probe_devices();
  bool any_active = false;
  for (const auto& d : devices) {
    for (const auto& p : d.ports) any_active = any_active || p.active;
  }
  const Availability a = probe_rdma();
  EXPECT_EQ(a.available, any_active) << a.detail;
  EXPECT_FALSE(a.detail.empty());
  if (!built_with_rdma()) {
    EXPECT_NE(a.detail.find("EMBER_WITH_RDMA"), std::string::npos);
  }
}

TEST(RdmaHost, RdmaWithoutADeviceIsAClearError) {
  if (probe_rdma().available) GTEST_SKIP() << "this host has an RDMA device: " << probe_rdma().detail;
  Options o;
  o.kind = Kind::kRdma;
  auto t = Transport::create(o);
  ASSERT_FALSE(t);
  EXPECT_EQ(t.error().code(), ErrorCode::kUnavailable);
  const std::string m = t.error().message();
  EXPECT_NE(m.find("transport = \"rdma\""), std::string::npos) << m;
  EXPECT_NE(m.find("\"tcp\""), std::string::npos) << "says what to use instead: " << m;
  // Invalid options are still reported first, as for the other kinds.
  o.num_channels = 0;
  auto bad = Transport::create(o);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().code(), ErrorCode::kConfig);
}

TEST(RdmaHost, ConfigAutoFallsBackWithoutADeviceAndRdmaIsKept) {
  if (probe_rdma().available) GTEST_SKIP() << "this host has an RDMA device: " << probe_rdma().detail;
  config::CommunicationConfig comm;
  comm.num_channels = 2;
  comm.transport = config::Transport::kAuto;
  auto remote = options_from_config(comm, /*peer_on_same_host=*/false);
  ASSERT_TRUE(remote) << remote.error().to_string();
  EXPECT_EQ(remote->kind, Kind::kTcp);
  auto local = options_from_config(comm, /*peer_on_same_host=*/true);
  ASSERT_TRUE(local);
  EXPECT_EQ(local->kind, Kind::kShm);
  comm.transport = config::Transport::kRdma;
  auto rdma = options_from_config(comm);
  ASSERT_TRUE(rdma) << "the config is valid; the missing device is Transport::create's error";
  EXPECT_EQ(rdma->kind, Kind::kRdma);
  auto t = Transport::create(*rdma);
  ASSERT_FALSE(t);
  EXPECT_EQ(t.error().code(), ErrorCode::kUnavailable);
}

TEST(RdmaHost, StatsAreOnlyForRdmaConnections) {
  // A Connection of another kind has no rdma counters (nothing to fake here:
  // rdma_stats must not misread a foreign object).
  struct Fake : Connection {
    PeerInfo p;
    const PeerInfo& peer() const noexcept override { return p; }
    Status send(std::uint32_t, std::span<const std::byte>, std::chrono::nanoseconds) override { return {}; }
    Status send(std::uint32_t, Buffer&&, SendCompletion, std::chrono::nanoseconds) override { return {}; }
    Status flush(std::uint32_t) override { return {}; }
    Status flush_all() override { return {}; }
    void close(std::chrono::nanoseconds) override {}
    bool is_closed() const noexcept override { return false; }
    ConnectionStats stats() const noexcept override { return {}; }
  };
  Fake f;
  EXPECT_FALSE(rdma_stats(f).has_value());
}

}  // namespace
}  // namespace ember::transport::rdma
