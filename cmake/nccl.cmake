# The nccl.h that src/parallel/comm.cpp is compiled against (included by CMakeLists.txt).
#
# ProcessGroupNCCL::Options holds an ncclConfig_t by value and ProcessGroupNCCL.hpp's members depend on
# NCCL_VERSION_CODE (NCCL_HAS_CONFIG, NCCL_HAS_COMM_SPLIT, ...), so comm.cpp must see the nccl.h of the
# NCCL LibTorch was built with: a header of another minor release lays the class out differently than
# libtorch_cuda.so does. NCCL changes ncclConfig_t and its feature set at minor releases only
# (ncclConfig_t is the same in 2.28.3, 2.28.7 and 2.28.9, and larger than in 2.27), so major.minor must
# match; a patch release may differ (said in the status line).
#
# LibTorch's NCCL version: SUBLINEAR_LIBTORCH_NCCL_VERSION when given, else the torch wheel's pin
# (METADATA: `Requires-Dist: nvidia-nccl-cu13==2.28.9`). Headers tried in order, the first of a
# matching version wins: SUBLINEAR_NCCL_INCLUDE when given, the nvidia-nccl wheel's include directory
# (where its RECORD puts nccl.h: nvidia/nccl/include for nvidia-nccl-cu12 and -cu13), the CUDA
# toolkit's. None matching, or the version unknown: the NCCL backend is left out with a warning (the
# build goes on: Gloo and one process need no NCCL, and `parallel.backend: nccl` then says it is
# missing), rather than compiled against a header that would corrupt ProcessGroupNCCL's options.

set(SUBLINEAR_NCCL_INCLUDE "" CACHE PATH
    "sublinear: directory of the nccl.h to build the NCCL backend against (default: the nvidia-nccl wheel's, then the CUDA toolkit's)")
set(SUBLINEAR_LIBTORCH_NCCL_VERSION "" CACHE STRING
    "sublinear: NCCL version LibTorch was built with, X.Y.Z (default: the torch wheel's nvidia-nccl pin)")

# NCCL_MAJOR.NCCL_MINOR.NCCL_PATCH of <dir>/nccl.h, or "" when it has none.
function(sublinear_nccl_header_version dir out)
  file(STRINGS "${dir}/nccl.h" defs REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  set(parts "")
  foreach(part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${part} +([0-9]+)" found "${defs}")
    if(NOT found)
      set(${out} "" PARENT_SCOPE)
      return()
    endif()
    list(APPEND parts ${CMAKE_MATCH_1})
  endforeach()
  list(JOIN parts "." version)
  set(${out} "${version}" PARENT_SCOPE)
endfunction()

# The NCCL version LibTorch was built with, or "" when nothing says.
function(sublinear_libtorch_nccl_version site out)
  if(SUBLINEAR_LIBTORCH_NCCL_VERSION)
    set(${out} "${SUBLINEAR_LIBTORCH_NCCL_VERSION}" PARENT_SCOPE)
    return()
  endif()
  file(GLOB metadata "${site}/torch-*.dist-info/METADATA")
  foreach(file ${metadata})
    file(STRINGS "${file}" pin REGEX "^Requires-Dist: nvidia-nccl-cu[0-9]+==[0-9]+\\.[0-9]+\\.[0-9]+")
    if(pin)
      string(REGEX MATCH "==([0-9]+\\.[0-9]+\\.[0-9]+)" found "${pin}")
      set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(${out} "" PARENT_SCOPE)
endfunction()

# Directories that may hold nccl.h, in the order they are tried.
function(sublinear_nccl_candidates site out)
  set(dirs ${SUBLINEAR_NCCL_INCLUDE})
  file(GLOB records "${site}/nvidia_nccl_cu*.dist-info/RECORD")
  foreach(record ${records})
    file(STRINGS "${record}" line REGEX "^[^,]*/include/nccl\\.h,")
    if(line)
      list(GET line 0 first)
      string(REGEX REPLACE "/nccl\\.h,.*" "" relative "${first}")
      list(APPEND dirs "${site}/${relative}")
    endif()
  endforeach()
  list(APPEND dirs ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  list(REMOVE_DUPLICATES dirs)
  set(${out} "${dirs}" PARENT_SCOPE)
endfunction()

# Sets <out> to the include directory of a nccl.h whose major.minor is LibTorch's NCCL's, or "".
# Prints which header it took, or why the NCCL backend is left out.
function(sublinear_nccl_include site out)
  set(${out} "" PARENT_SCOPE)
  if(NOT TORCH_CUDA_LIBRARIES)
    message(STATUS "sublinear: NCCL: left out (LibTorch is a CPU build)")
    return()
  endif()
  sublinear_libtorch_nccl_version("${site}" want)
  if(NOT want)
    message(WARNING "sublinear: NCCL: left out: the NCCL version LibTorch was built with is unknown (the torch "
                    "wheel's METADATA pins no nvidia-nccl); pass -DSUBLINEAR_LIBTORCH_NCCL_VERSION=X.Y.Z")
    return()
  endif()
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" want_minor "${want}")
  sublinear_nccl_candidates("${site}" dirs)
  set(seen "")
  foreach(dir ${dirs})
    if(NOT EXISTS "${dir}/nccl.h")
      continue()
    endif()
    sublinear_nccl_header_version("${dir}" have)
    list(APPEND seen "${dir}/nccl.h (${have})")
    string(REGEX MATCH "^[0-9]+\\.[0-9]+" have_minor "${have}")
    if(have_minor AND have_minor STREQUAL want_minor)
      set(note "")
      if(NOT have STREQUAL want)
        set(note ", another patch release of ${want_minor}")
      endif()
      message(STATUS "sublinear: NCCL: ${dir}/nccl.h, NCCL ${have} (LibTorch's: ${want}${note})")
      set(${out} "${dir}" PARENT_SCOPE)
      return()
    endif()
  endforeach()
  if(NOT seen)
    set(seen "none found")
  endif()
  list(JOIN seen ", " seen)
  message(WARNING "sublinear: NCCL: left out: no nccl.h of NCCL ${want_minor}.x, the version LibTorch was built "
                  "with (${want}), among the headers tried: ${seen}. Install nvidia-nccl-cuXX==${want} beside torch, "
                  "or point SUBLINEAR_NCCL_INCLUDE at the include directory of that NCCL")
endfunction()
