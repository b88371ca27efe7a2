# Protocol decoder fuzz target (common/proto); seeds: one message per type.
ember_add_fuzzer(proto_fuzz SOURCES proto_fuzz.cc DEPS ember_proto CORPUS tests/fuzz/corpus/proto)
