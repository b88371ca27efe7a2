# Fashion-MNIST IDX reader fuzz target (examples/fashion_mnist/data); seeds:
# small plain and gzip IDX files (first byte = expected rank - 1).
ember_add_fuzzer(idx_fuzz SOURCES idx_fuzz.cc DEPS ember_fashion_mnist CORPUS tests/fuzz/corpus/idx)
