# `cmake --install` lays down headers, static libraries, the tools, and a CMake
# package so another project can:
#   find_package(tierzero REQUIRED)
#   target_link_libraries(app PRIVATE tierzero::engine)
include(CMakePackageConfigHelpers)

get_property(_tz_modules GLOBAL PROPERTY TIERZERO_MODULES)
install(TARGETS ${_tz_modules}
  EXPORT tierzeroTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

set(TIERZERO_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/tierzero)
install(EXPORT tierzeroTargets NAMESPACE tierzero:: DESTINATION ${TIERZERO_INSTALL_CMAKEDIR})
configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/tierzeroConfig.cmake.in
  ${PROJECT_BINARY_DIR}/tierzeroConfig.cmake
  INSTALL_DESTINATION ${TIERZERO_INSTALL_CMAKEDIR})
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/tierzeroConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/tierzeroConfig.cmake
  ${PROJECT_BINARY_DIR}/tierzeroConfigVersion.cmake
  DESTINATION ${TIERZERO_INSTALL_CMAKEDIR})

# `pip install .` (scikit-build-core sets SKBUILD): the tools go into the
# environment's scripts directory (its bin/, on PATH once it is active), and
# what tierzero-train reads beside its bin/ (the corpus, the example config)
# into the environment's share/tierzero, through the wheel's data scheme. Only
# the `python` component goes into the wheel (pyproject.toml).
if(DEFINED SKBUILD)
  set(_tz_tools tierzero-info tierzero-estimate tierzero-train)
  if(TARGET tierzero-nvme-bench)
    list(APPEND _tz_tools tierzero-nvme-bench)
  endif()
  install(TARGETS ${_tz_tools} RUNTIME DESTINATION ${SKBUILD_SCRIPTS_DIR} COMPONENT python)
  install(FILES ${PROJECT_SOURCE_DIR}/data/kjv.txt ${PROJECT_SOURCE_DIR}/data/README.md
    DESTINATION ${SKBUILD_DATA_DIR}/${CMAKE_INSTALL_DATADIR}/tierzero/data COMPONENT python)
  install(FILES ${PROJECT_SOURCE_DIR}/examples/train_cpu_nvme.json
    DESTINATION ${SKBUILD_DATA_DIR}/${CMAKE_INSTALL_DATADIR}/tierzero/examples COMPONENT python)
endif()
