# What an engine runs to install the header-only library on a machine with CMake and a compiler
# only: configure (GoogleTest hidden, CUDA off, GDN_BUILD_TESTS left at its default), build and
# install into PREFIX. The configure must say that the tests are off; then GDN_BUILD_TESTS=ON must
# fail at configure, naming GoogleTest.
#   cmake -DSOURCE_DIR=<libgdn> -DWORK_DIR=<scratch> -DPREFIX=<prefix> -DGENERATOR=<gen>
#         -DCXX=<compiler> -P install_without_gtest.cmake
foreach(var SOURCE_DIR WORK_DIR PREFIX GENERATOR CXX)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "install_without_gtest.cmake needs -D${var}=...")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR} ${PREFIX})
set(configure ${CMAKE_COMMAND} -S ${SOURCE_DIR} -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX}
              -DGDN_ENABLE_CUDA=OFF -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON)

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed:\n${out}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

run("configure without GoogleTest" ${configure} -B ${WORK_DIR}/build)
if(NOT out MATCHES "gdn: C\\+\\+ tests off: GoogleTest not found")
  message(FATAL_ERROR "configure without GoogleTest did not say that the tests are off:\n${out}")
endif()
run("build" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run("install" ${CMAKE_COMMAND} --install ${WORK_DIR}/build --prefix ${PREFIX})
foreach(file include/gdn/gdn.hpp share/cmake/gdn/gdnConfig.cmake share/cmake/gdn/gdnTargets.cmake)
  if(NOT EXISTS ${PREFIX}/${file})
    message(FATAL_ERROR "install without GoogleTest: ${PREFIX}/${file} is missing")
  endif()
endforeach()
message(STATUS "configure, build and install without GoogleTest: ok")

execute_process(COMMAND ${configure} -B ${WORK_DIR}/build_tests_on -DGDN_BUILD_TESTS=ON
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc EQUAL 0 OR NOT out MATCHES "GDN_BUILD_TESTS=ON but GoogleTest was not found")
  message(FATAL_ERROR "GDN_BUILD_TESTS=ON without GoogleTest did not fail naming GoogleTest:\n${out}")
endif()
message(STATUS "GDN_BUILD_TESTS=ON without GoogleTest fails at configure: ok")
