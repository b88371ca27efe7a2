# Fuzz target for the frame decoder (common/wire). Included by tests/fuzz/CMakeLists.txt.
# Seed corpus: tests/fuzz/corpus/wire, written by wire_make_corpus (tests/unit/wire).
#
# Under EMBER_FUZZ the wire sources are compiled into the fuzzer itself, not
# linked from ember_wire: ember_add_fuzzer puts -fsanitize=fuzzer,address,undefined
# on the fuzz target's own sources only, and the decoder is what needs the
# coverage feedback and the ASan bounds checks.
if(EMBER_FUZZ)
  ember_add_fuzzer(wire_decoder_fuzz
    SOURCES
      ${CMAKE_CURRENT_LIST_DIR}/wire_decoder_fuzz.cc
      ${PROJECT_SOURCE_DIR}/common/wire/crc32c.cc
      ${PROJECT_SOURCE_DIR}/common/wire/frame_decoder.cc
    DEPS ember_base PkgConfig::ISAL
    CORPUS tests/fuzz/corpus/wire)
else()
  ember_add_fuzzer(wire_decoder_fuzz
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/wire_decoder_fuzz.cc
    DEPS ember_wire
    CORPUS tests/fuzz/corpus/wire)
endif()
