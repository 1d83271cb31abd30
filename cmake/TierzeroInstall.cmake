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
