# Every third-party dependency, found once. Debian packages (scripts/setup.sh installs them).
find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(TBB REQUIRED)
# Debian's xsimd 8 exports a link to a target `xtl` that no package provides;
# xsimd itself is header-only and does not need it.
if(NOT TARGET xtl)
  add_library(xtl INTERFACE IMPORTED)
endif()
find_package(xsimd REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(LIBURING REQUIRED IMPORTED_TARGET liburing)
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)
# Gloo: the CPU collectives (libgloo-dev; imported target `gloo`).
find_package(Gloo REQUIRED)
if(NOT TARGET gloo)
  message(FATAL_ERROR "Gloo was found but defines no `gloo` target; install Debian's libgloo-dev")
endif()

# MPI: how ranks started by mpirun meet (Note [MPI rendezvous]); Debian's
# libopenmpi-dev. TIERZERO_MPI=AUTO (the default) uses it when found.
set(TIERZERO_MPI AUTO CACHE STRING "Meet through MPI under mpirun: ON, OFF or AUTO (when found)")
set_property(CACHE TIERZERO_MPI PROPERTY STRINGS ON OFF AUTO)
set(TIERZERO_WITH_MPI OFF)
if(NOT TIERZERO_MPI STREQUAL "OFF")
  # MPI's C API from C++; not the long-deprecated C++ bindings (libmpi_cxx).
  set(MPI_CXX_SKIP_MPICXX ON)
  if(TIERZERO_MPI STREQUAL "ON")
    find_package(MPI REQUIRED COMPONENTS CXX)
  else()
    find_package(MPI COMPONENTS CXX)
  endif()
  if(MPI_CXX_FOUND)
    set(TIERZERO_WITH_MPI ON)
  else()
    message(STATUS "MPI not found (libopenmpi-dev): ranks under mpirun meet in a rendezvous directory")
  endif()
endif()

# NCCL: the GPU collectives. TIERZERO_NCCL says whether the engine builds its
# NCCL backend; TIERZERO_NCCL_STATUS says why (it ends up in error messages).
set(TIERZERO_NCCL OFF)
set(TIERZERO_NCCL_STATUS "built with TIERZERO_CUDA=OFF")
if(TIERZERO_CUDA)
  find_package(CUDAToolkit REQUIRED)
  # NCCL ships inside the toolkit tree on our machines; elsewhere point
  # NCCL_ROOT at it.
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_ROOT PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_ROOT PATH_SUFFIXES lib lib64)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(TIERZERO_NCCL ON)
    set(TIERZERO_NCCL_STATUS "NCCL ${NCCL_LIBRARY}")
  else()
    set(TIERZERO_NCCL_STATUS "NCCL not found at configure time (set NCCL_ROOT)")
    message(STATUS "NCCL not found (set NCCL_ROOT); building the engine without its NCCL backend")
  endif()
endif()
