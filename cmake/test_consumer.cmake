# Installs ferry into a scratch prefix, builds examples/consumer against the installed package and
# runs it: proves `cmake --install` + find_package(ferry) work for another project.
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
