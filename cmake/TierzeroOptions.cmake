# Build options shared by every module.

# CUDA: on when nvcc is found, unless the user says otherwise.
if(NOT DEFINED TIERZERO_CUDA)
  find_program(_tz_nvcc nvcc HINTS /usr/local/cuda/bin ENV CUDA_HOME PATH_SUFFIXES bin)
  if(_tz_nvcc)
    set(_tz_cuda_default ON)
  else()
    set(_tz_cuda_default OFF)
  endif()
  set(TIERZERO_CUDA ${_tz_cuda_default} CACHE BOOL "Build the CUDA backend and kernels")
endif()

if(TIERZERO_CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    find_program(CMAKE_CUDA_COMPILER nvcc HINTS /usr/local/cuda/bin ENV CUDA_HOME PATH_SUFFIXES bin)
  endif()
  # Hopper only by default: the GPUs we run on are H100/H200, and every extra
  # architecture costs minutes on a 2-core build. Override with -DCMAKE_CUDA_ARCHITECTURES.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
  # CMake 3.25 does not know nvcc 12+'s C++20 dialect flag; teach it, so the
  # cxx_std_20 requirement of our targets carries over to .cu files.
  if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
  endif()
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
endif()

option(TIERZERO_SANITIZE "Build with AddressSanitizer and UndefinedBehaviorSanitizer" OFF)
if(TIERZERO_SANITIZE)
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
endif()

find_program(_tz_ccache ccache)
if(_tz_ccache AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${_tz_ccache})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${_tz_ccache})
endif()

set(TIERZERO_WARNINGS -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wno-missing-field-initializers)
