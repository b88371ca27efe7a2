# Handshake and rdma wire decoders (common/transport/handshake, rdma/protocol);
# seeds: one valid input per decoder (first byte = decoder).
ember_add_fuzzer(handshake_fuzz SOURCES handshake_fuzz.cc DEPS ember_transport
                 CORPUS tests/fuzz/corpus/handshake)
