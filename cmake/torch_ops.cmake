# libgdn_torch_ops: the C++ kernels of the torch ops (src/torch_ops/kernels.cpp), a plain shared
# library that gdn/ops.py loads with torch.ops.load_library. Built when the build's Python imports
# torch (GDN_BUILD_TORCH_OPS: AUTO builds it then, ON requires it, OFF never), against that torch's
# headers and libraries as it reports them (cmake/torch_build_info.py; nothing is downloaded).
# A C++ torch extension is tied to the torch it was compiled against, so torch_ops.json, installed
# next to it, records that torch's version: ops.py loads the library only into the same version.
# Included from CMakeLists.txt once Python_EXECUTABLE is known.

set(GDN_TORCH_OPS OFF)
if(GDN_BUILD_TORCH_OPS STREQUAL "OFF")
  message(STATUS "gdn: torch op kernels OFF (GDN_BUILD_TORCH_OPS=OFF); torch.ops.gdn.* use Python "
                 "kernels")
else()
  execute_process(COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_LIST_DIR}/torch_build_info.py"
                  RESULT_VARIABLE _gdn_torch_rc OUTPUT_VARIABLE _gdn_torch_info
                  ERROR_VARIABLE _gdn_torch_error)
  foreach(_key version cxx11_abi cuda include_dirs library_dir)
    string(REGEX MATCH "(^|\n)${_key}=([^\n]*)" _gdn_match "${_gdn_torch_info}")
    set(_gdn_torch_${_key} "${CMAKE_MATCH_2}")
  endforeach()
  set(_gdn_why "")
  if(NOT _gdn_torch_rc EQUAL 0)
    string(STRIP "${_gdn_torch_error}" _gdn_torch_error)
    string(REGEX REPLACE ".*\n" "" _gdn_torch_error "${_gdn_torch_error}")  # the exception line
    set(_gdn_why "${Python_EXECUTABLE} cannot import torch: ${_gdn_torch_error}")
  elseif(_gdn_torch_cuda AND GDN_HAS_CUDA AND NOT _gdn_torch_cxx11_abi)
    # The kernels library is compiled in the default (C++11) ABI, and its entry points return a
    # gdn::Status, which holds a std::string: the two ABIs lay it out differently.
    set(_gdn_why "torch ${_gdn_torch_version} uses the pre-C++11 std::string ABI, unlike the CUDA "
                 "kernel library it would link")
  endif()
  if(_gdn_why AND GDN_BUILD_TORCH_OPS STREQUAL "ON")
    message(FATAL_ERROR "GDN_BUILD_TORCH_OPS=ON but ${_gdn_why}")
  elseif(_gdn_why)
    message(STATUS "gdn: torch op kernels OFF (${_gdn_why}); torch.ops.gdn.* use Python kernels")
  else()
    set(GDN_TORCH_OPS ON)
  endif()
endif()

if(GDN_TORCH_OPS)
  if(NOT _gdn_torch_cuda)
    set(_gdn_keys "CPU kernels (a CPU torch)")
  elseif(GDN_HAS_CUDA)
    set(_gdn_keys "CPU and CUDA kernels")
  else()
    set(_gdn_keys "CPU kernels; CUDA calls raise, this build has no CUDA kernels")
  endif()
  message(STATUS "gdn: torch op kernels ON (torch ${_gdn_torch_version}: ${_gdn_keys})")
  set(_gdn_torch_libraries)
  foreach(_lib c10 torch_cpu)
    find_library(_gdn_torch_lib ${_lib} PATHS "${_gdn_torch_library_dir}" NO_DEFAULT_PATH NO_CACHE
                 REQUIRED)
    list(APPEND _gdn_torch_libraries "${_gdn_torch_lib}")
    unset(_gdn_torch_lib)
  endforeach()

  add_library(gdn_torch_ops SHARED ${PROJECT_SOURCE_DIR}/src/torch_ops/kernels.cpp)
  target_include_directories(gdn_torch_ops SYSTEM PRIVATE ${_gdn_torch_include_dirs})
  target_include_directories(gdn_torch_ops PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_compile_definitions(gdn_torch_ops PRIVATE _GLIBCXX_USE_CXX11_ABI=${_gdn_torch_cxx11_abi})
  target_link_libraries(gdn_torch_ops PRIVATE gdn ${_gdn_torch_libraries})
  if(_gdn_torch_cuda)
    # The CUDA dispatch key gets the kernels too. They launch the CUDA kernels on torch's current
    # stream, which needs c10_cuda: only a CUDA torch has it (and only a CUDA torch has CUDA
    # tensors). Without this build's CUDA kernels, a CUDA call raises the gdn function's error.
    target_compile_definitions(gdn_torch_ops PRIVATE GDN_TORCH_HAS_CUDA=1)
    if(GDN_HAS_CUDA)
      find_library(_gdn_c10_cuda c10_cuda PATHS "${_gdn_torch_library_dir}" NO_DEFAULT_PATH
                   NO_CACHE REQUIRED)
      target_link_libraries(gdn_torch_ops PRIVATE gdn_kernels "${_gdn_c10_cuda}")
    endif()
  endif()
  # Nothing of the library or of the static kernels in it is exported: torch finds the kernels
  # through the registrations its static initialisers make.
  set_target_properties(gdn_torch_ops PROPERTIES CXX_VISIBILITY_PRESET hidden
                        VISIBILITY_INLINES_HIDDEN ON)
  if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
    target_link_options(gdn_torch_ops PRIVATE "LINKER:--exclude-libs,ALL")
  endif()
  file(GENERATE OUTPUT ${PROJECT_BINARY_DIR}/torch_ops.json CONTENT
       "{\"library\": \"$<TARGET_FILE_NAME:gdn_torch_ops>\", \"torch\": \"${_gdn_torch_version}\"}\n")
  install(TARGETS gdn_torch_ops LIBRARY DESTINATION gdn COMPONENT python)
  install(FILES ${PROJECT_BINARY_DIR}/torch_ops.json DESTINATION gdn COMPONENT python)
endif()
