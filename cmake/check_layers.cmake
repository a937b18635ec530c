# The library's layers, enforced: a file of one layer includes only its own layer's headers and those of
# layers below it (docs/architecture.md). Run by the build (target ferry_layers, part of `all`) and by a
# test that shows it failing on an upward include.
#
#   cmake -DROOT=<source dir> [-DSTAMP=<file touched when clean>] -P cmake/check_layers.cmake
#
# Ranks: core; mem; net and device; xfer and vm; io; store; gpu. Layers of one rank do not use each other.
set(_ranks core 0 mem 1 net 2 device 2 xfer 3 vm 3 io 4 store 5 gpu 6)
set(_layers)
list(LENGTH _ranks _n)
math(EXPR _last "${_n} - 1")
foreach(_i RANGE 0 ${_last} 2)
  list(GET _ranks ${_i} _name)
  math(EXPR _j "${_i} + 1")
  list(GET _ranks ${_j} _rank)
  set(_rank_${_name} ${_rank})
  list(APPEND _layers ${_name})
endforeach()

if(NOT ROOT)
  message(FATAL_ERROR "check_layers: give -DROOT=<source dir>")
endif()

set(_violations)
foreach(_layer IN LISTS _layers)
  file(GLOB_RECURSE _files "${ROOT}/src/${_layer}/*.hpp" "${ROOT}/src/${_layer}/*.cpp" "${ROOT}/src/${_layer}/*.cu"
       "${ROOT}/include/ferry/${_layer}/*.hpp")
  foreach(_file IN LISTS _files)
    file(STRINGS "${_file}" _includes REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]")
    foreach(_line IN LISTS _includes)
      # The top-level headers (the runtime, every layer's settings gathered, the drop-in for programs
      # written for CUDA managed memory) sit above every layer.
      if(_line MATCHES "#[ \t]*include[ \t]*[<\"]ferry/(runtime|settings|cuda_managed)\\.hpp[>\"]")
        file(RELATIVE_PATH _rel "${ROOT}" "${_file}")
        string(STRIP "${_line}" _line)
        list(APPEND _violations "  ${_rel} (${_layer}) includes the top level: ${_line}")
      endif()
      if(_line MATCHES "#[ \t]*include[ \t]*[<\"](ferry/)?([a-z_]+)/")
        set(_used "${CMAKE_MATCH_2}")
        if(DEFINED _rank_${_used} AND NOT _used STREQUAL _layer)
          if(NOT _rank_${_used} LESS _rank_${_layer})
            file(RELATIVE_PATH _rel "${ROOT}" "${_file}")
            string(STRIP "${_line}" _line)
            list(APPEND _violations "  ${_rel} (${_layer}) includes ${_used}: ${_line}")
          endif()
        endif()
      endif()
    endforeach()
  endforeach()
endforeach()

if(_violations)
  list(JOIN _violations "\n" _text)
  message(FATAL_ERROR "layer violations: a layer may include only its own and lower layers "
                      "(core; mem; net, device; xfer, vm; io; store; gpu -- docs/architecture.md):\n${_text}")
endif()
if(STAMP)
  file(TOUCH "${STAMP}")
endif()
