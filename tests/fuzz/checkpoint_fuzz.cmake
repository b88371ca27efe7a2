# Checkpoint parser fuzz target (server/checkpoint); seeds: small valid files.
ember_add_fuzzer(checkpoint_fuzz SOURCES checkpoint_fuzz.cc DEPS ember_server_core
                 CORPUS tests/fuzz/corpus/checkpoint)
