# Installs ferry into a scratch prefix, builds examples/consumer against the installed package and
# runs it: proves `cmake --install` + find_package(ferry) work for another project. Also runs the
# installed programs with no library path set: they find libferry from their own RPATH.
#   cmake -DBUILD=<ferry build dir> -DSRC=<ferry source dir> -P cmake/test_consumer.cmake
set(prefix ${BUILD}/consumer-test/prefix)
set(cbuild ${BUILD}/consumer-test/build)
file(REMOVE_RECURSE ${BUILD}/consumer-test)
macro(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endmacro()
run(${CMAKE_COMMAND} --install ${BUILD} --prefix ${prefix})
run(${CMAKE_COMMAND} -S ${SRC}/examples/consumer -B ${cbuild} -G Ninja -DCMAKE_PREFIX_PATH=${prefix})
run(${CMAKE_COMMAND} --build ${cbuild})
run(${CMAKE_COMMAND} -E env FERRY_BACKEND=sim ${cbuild}/ferry_consumer)
run(${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH FERRY_BACKEND=sim ${prefix}/bin/ferry info)
run(${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH ${prefix}/bin/ferry-bench --version)
message(STATUS "installed bin/ferry info and bin/ferry-bench --version: exit 0")
