# Install layout (GNUInstallDirs), included last by the top-level CMakeLists:
#   cmake --install build/release --prefix /usr/local
# gives
#   bin/ember-server, bin/emberctl
#   lib/libember.so* and include/ember/ember.h     (rules in capi/CMakeLists.txt)
#   lib/systemd/system/ember-server.service         (paths rewritten to this prefix)
#   lib/sysctl.d/99-ember-hugepages.conf             (hugepages at boot)
#   libexec/ember/reserve-hugepages.sh               (the unit's ExecStartPre)
#   share/doc/ember/{README.md,*.md}, share/doc/ember/examples/ember.toml
# The unit and sysctl drop-in go under lib/ (not LIBDIR: systemd looks in
# <prefix>/lib/systemd/system and <prefix>/lib/sysctl.d, never in a multiarch
# directory). tests/integration/server/install_test.sh installs into a
# temporary prefix and starts the installed binaries.
include(GNUInstallDirs)

if(TARGET ember-server)
  install(TARGETS ember-server RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
if(TARGET emberctl)
  install(TARGETS emberctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

set(ember_docdir ${CMAKE_INSTALL_DATAROOTDIR}/doc/ember)
install(FILES README.md DESTINATION ${ember_docdir})
install(DIRECTORY docs/ DESTINATION ${ember_docdir} FILES_MATCHING PATTERN "*.md")
install(FILES config/ember.toml DESTINATION ${ember_docdir}/examples)

install(PROGRAMS deploy/systemd/reserve-hugepages.sh
        DESTINATION ${CMAKE_INSTALL_LIBEXECDIR}/ember)
install(FILES deploy/systemd/99-ember-hugepages.conf DESTINATION lib/sysctl.d)

# The unit in deploy/systemd names the /usr/local paths; the installed copy
# names the paths of the prefix given at install time (cmake --install
# --prefix), so this runs then, not at configure time.
install(CODE "
  set(ember_unit_src \"${PROJECT_SOURCE_DIR}/deploy/systemd/ember-server.service\")
  set(ember_unit_tmp \"${PROJECT_BINARY_DIR}/install/ember-server.service\")
  set(ember_bindir \"${CMAKE_INSTALL_BINDIR}\")
  set(ember_libexecdir \"${CMAKE_INSTALL_LIBEXECDIR}\")
  set(ember_docdir \"${ember_docdir}\")
")
install(CODE [[
  foreach(dir bindir libexecdir docdir)
    if(NOT IS_ABSOLUTE "${ember_${dir}}")
      set(ember_${dir} "${CMAKE_INSTALL_PREFIX}/${ember_${dir}}")
    endif()
  endforeach()
  file(READ "${ember_unit_src}" unit)
  string(REPLACE "/usr/local/bin/ember-server" "${ember_bindir}/ember-server" unit "${unit}")
  string(REPLACE "/usr/local/libexec/ember/reserve-hugepages.sh"
                 "${ember_libexecdir}/ember/reserve-hugepages.sh" unit "${unit}")
  string(REPLACE "/usr/local/share/doc/ember" "${ember_docdir}" unit "${unit}")
  file(WRITE "${ember_unit_tmp}" "${unit}")
  file(INSTALL "${ember_unit_tmp}" DESTINATION "${CMAKE_INSTALL_PREFIX}/lib/systemd/system"
       PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
]])
