# Fuzz target for the TOML config loader (common/config); see config_fuzz.cc.
ember_add_fuzzer(config_fuzz SOURCES config_fuzz.cc DEPS ember_config CORPUS tests/fuzz/corpus/config)
if(NOT EMBER_FUZZ)
  # toml11 is slow in unoptimised builds (it recounts lines from the start of
  # the input on every error it builds, ~1 ms per input here), so the replay
  # runs 5000 random inputs instead of 20000 to stay well inside its timeout.
  set_tests_properties(fuzz_replay.config_fuzz PROPERTIES ENVIRONMENT EMBER_FUZZ_REPLAY_RUNS=5000)
endif()
