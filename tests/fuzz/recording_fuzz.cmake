# Communication-recording reader fuzz target (common/record); seeds: small
# complete and cut recordings.
ember_add_fuzzer(recording_fuzz SOURCES recording_fuzz.cc DEPS ember_record
                 CORPUS tests/fuzz/corpus/recording)
