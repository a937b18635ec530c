# CUDA is optional twice:
#  - at build time the cuda backend is compiled only when nvcc is found;
#  - at run time nothing links against libcuda.so.1: the driver API is resolved through
#    dlopen + cuGetProcAddress (src/device/cuda/driver.cpp), so binaries start without a driver.
# Only cuda.h (types) is used from the toolkit by C++ code; kernels are compiled by nvcc into a
# fatbin that is embedded in the library and loaded with cuModuleLoadData.
set(FERRY_HAVE_CUDA OFF)
if(FERRY_WITH_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  # Only cuda.h is needed, found next to nvcc. (FindCUDAToolkit of CMake 3.25 fails on CUDA 13,
  # which no longer ships nvToolsExt, so it is not used.)
  if(CMAKE_CUDA_COMPILER)
    get_filename_component(_nvcc_dir "${CMAKE_CUDA_COMPILER}" DIRECTORY)
    find_path(FERRY_CUDA_INCLUDE_DIR cuda.h
      HINTS "${_nvcc_dir}/../include" "${_nvcc_dir}/../targets/x86_64-linux/include" NO_DEFAULT_PATH)
    execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --version OUTPUT_VARIABLE _nvcc_out ERROR_QUIET)
    string(REGEX MATCH "release ([0-9]+\\.[0-9]+)" _m "${_nvcc_out}")
    set(FERRY_CUDA_VERSION "${CMAKE_MATCH_1}")
    # The static CUDA runtime, for the test that plays a program written for the runtime API
    # (tests/vm/gpu_managed_test.cpp); ferry itself never links it.
    find_library(FERRY_CUDART_STATIC cudart_static
      HINTS "${_nvcc_dir}/../lib64" "${_nvcc_dir}/../targets/x86_64-linux/lib" NO_DEFAULT_PATH)
  endif()
  if(CMAKE_CUDA_COMPILER AND FERRY_CUDA_INCLUDE_DIR)
    set(FERRY_HAVE_CUDA ON)
    set(FERRY_CUDA_ARCHS "80;90" CACHE STRING "SASS architectures embedded in the kernel fatbin (PTX of the last is added)")
    message(STATUS "ferry: CUDA backend ON (nvcc ${CMAKE_CUDA_COMPILER}, CUDA ${FERRY_CUDA_VERSION}, ${FERRY_CUDA_INCLUDE_DIR})")
  else()
    message(STATUS "ferry: CUDA backend OFF (nvcc or cuda.h not found)")
  endif()
endif()

# ferry_embed_fatbin(<target> <out_var_cpp> <cu file> <symbol>)
# Compiles one .cu file to a fatbin with nvcc and turns it into a C++ source defining
# `extern const unsigned char <symbol>[]` and `<symbol>_size`.
function(ferry_embed_fatbin out_cpp cu_file symbol)
  set(fatbin ${CMAKE_CURRENT_BINARY_DIR}/${symbol}.fatbin)
  set(cpp ${CMAKE_CURRENT_BINARY_DIR}/${symbol}.cpp)
  set(gencode "")
  foreach(a IN LISTS FERRY_CUDA_ARCHS)
    list(APPEND gencode -gencode arch=compute_${a},code=sm_${a})
    set(last ${a})
  endforeach()
  list(APPEND gencode -gencode arch=compute_${last},code=compute_${last})
  set(launcher "")
  find_program(FERRY_CCACHE ccache)
  if(FERRY_CCACHE)
    set(launcher ${FERRY_CCACHE})
  endif()
  add_custom_command(
    OUTPUT ${fatbin}
    COMMAND ${launcher} ${CMAKE_CUDA_COMPILER} --fatbin -O3 -std=c++17 -I${PROJECT_SOURCE_DIR}/include ${gencode} -o ${fatbin} ${cu_file}
    DEPENDS ${cu_file} ${PROJECT_SOURCE_DIR}/include/ferry/gpu/ring.hpp ${PROJECT_SOURCE_DIR}/include/ferry/gpu/page_cache.hpp
            ${PROJECT_SOURCE_DIR}/include/ferry/gpu/array.hpp
    COMMENT "nvcc --fatbin ${cu_file}")
  add_custom_command(
    OUTPUT ${cpp}
    COMMAND ${CMAKE_COMMAND} -DIN=${fatbin} -DOUT=${cpp} -DSYMBOL=${symbol} -P ${PROJECT_SOURCE_DIR}/cmake/embed.cmake
    DEPENDS ${fatbin} ${PROJECT_SOURCE_DIR}/cmake/embed.cmake)
  set(${out_cpp} ${cpp} PARENT_SCOPE)
endfunction()
