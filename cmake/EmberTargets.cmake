# Per-target defaults: warnings, sanitizers, include root.
# ember_target_defaults(<target>) is called for every Ember target.
function(ember_target_defaults target)
  target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
      -Wcast-align -Wunused -Woverloaded-virtual -Wnull-dereference -Wimplicit-fallthrough>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>>:-Wno-interference-size>)
  if(EMBER_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
    # GCC 12 at -O1 and above (release, tsan presets) reports
    # -Wnull-dereference and -Wrestrict inside Boost.Asio, CLI11 and
    # libstdc++ headers after inlining (false positives in code that is not
    # Ember's); they stay warnings there. The Debug presets keep them errors.
    target_compile_options(${target} PRIVATE
      $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>,$<NOT:$<CONFIG:Debug>>>:-Wno-error=null-dereference -Wno-error=restrict>)
  endif()
  if(EMBER_SANITIZE)
    # GCC's -Wtsan: ThreadSanitizer does not model atomic_thread_fence (used
    # by Boost.Asio and by the shm lanes, whose fences pair with atomics TSan
    # does see); a warning per fence is noise.
    if(EMBER_SANITIZE MATCHES "thread")
      target_compile_options(${target} PRIVATE $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>>:-Wno-tsan>)
    endif()
    target_compile_options(${target} PRIVATE -fsanitize=${EMBER_SANITIZE} -fno-omit-frame-pointer
                                             -fno-sanitize-recover=all)
    target_link_options(${target} PRIVATE -fsanitize=${EMBER_SANITIZE})
  endif()
endfunction()

# ember_add_library(<name> SOURCES ... DEPS ...)
function(ember_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  ember_target_defaults(${name})
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
endfunction()

# ember_add_executable(<name> SOURCES ... DEPS ...)
function(ember_add_executable name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  ember_target_defaults(${name})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
endfunction()

# ember_add_test(<name> LABELS ... SOURCES ... DEPS ... [TIMEOUT s])
# One GoogleTest binary; every TEST is registered with ctest with its labels.
function(ember_add_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  ember_target_defaults(${name})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  gtest_discover_tests(${name}
    PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT}
    DISCOVERY_TIMEOUT 60)
endfunction()

# ember_add_fuzzer(<name> SOURCES ... DEPS ...)
# Under EMBER_FUZZ (clang): a libFuzzer binary, registered as a ctest with a
# short -max_total_time run and label `fuzz`. Otherwise: the same entry point
# linked with tests/fuzz/replay_main.cc, which replays the seed corpus and a
# fixed number of seeded random inputs, so the decoder paths run in every build.
function(ember_add_fuzzer name)
  cmake_parse_arguments(ARG "" "CORPUS" "SOURCES;DEPS" ${ARGN})
  if(EMBER_FUZZ)
    add_executable(${name} ${ARG_SOURCES})
    ember_target_defaults(${name})
    target_compile_options(${name} PRIVATE -fsanitize=fuzzer,address,undefined)
    target_link_options(${name} PRIVATE -fsanitize=fuzzer,address,undefined)
    target_link_libraries(${name} PRIVATE ${ARG_DEPS})
    # libFuzzer writes the inputs it finds into its first corpus directory:
    # a build-tree one, so that runs never add files to the source tree; the
    # seed corpus follows, read only.
    set(new_inputs ${CMAKE_CURRENT_BINARY_DIR}/corpus-${name})
    file(MAKE_DIRECTORY ${new_inputs})
    set(corpus_args ${new_inputs})
    if(ARG_CORPUS)
      list(APPEND corpus_args ${PROJECT_SOURCE_DIR}/${ARG_CORPUS})
    endif()
    set_property(GLOBAL APPEND PROPERTY EMBER_FUZZ_TARGETS ${name})
    add_test(NAME fuzz.${name}
      COMMAND ${name} -max_total_time=${EMBER_FUZZ_SECONDS} -seed=1 -print_final_stats=1 ${corpus_args})
    set_tests_properties(fuzz.${name} PROPERTIES LABELS fuzz TIMEOUT 300)
  else()
    add_executable(${name}_replay ${ARG_SOURCES} ${PROJECT_SOURCE_DIR}/tests/fuzz/replay_main.cc)
    set_property(GLOBAL APPEND PROPERTY EMBER_FUZZ_TARGETS ${name}_replay)
    ember_target_defaults(${name}_replay)
    target_link_libraries(${name}_replay PRIVATE ${ARG_DEPS})
    set(corpus_args "")
    if(ARG_CORPUS)
      set(corpus_args ${PROJECT_SOURCE_DIR}/${ARG_CORPUS})
    endif()
    add_test(NAME fuzz_replay.${name} COMMAND ${name}_replay ${corpus_args})
    set_tests_properties(fuzz_replay.${name} PROPERTIES LABELS "fuzz;unit" TIMEOUT 120)
  endif()
endfunction()
