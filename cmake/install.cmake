# install.cmake - libexl as a shared library beside the static one, `cmake --install` (exl, libexl.a,
# libexl.so.MAJOR.MINOR.PATCH, exl.h, exl.pc, the embedded model, the CUDA backend when built), and the Python
# package's files when scikit-build-core builds the wheel (SKBUILD: only component `python`).
include(GNUInstallDirs)

# the version, from the one public header
file(STRINGS include/exl.h EXL_VERSION_LINES REGEX "^#define EXL_VERSION_(MAJOR|MINOR|PATCH) ")
foreach(line ${EXL_VERSION_LINES})
  if(line MATCHES "EXL_VERSION_(MAJOR|MINOR|PATCH) ([0-9]+)")
    set(EXL_VERSION_${CMAKE_MATCH_1} ${CMAKE_MATCH_2})
  endif()
endforeach()
set(EXL_VERSION "${EXL_VERSION_MAJOR}.${EXL_VERSION_MINOR}.${EXL_VERSION_PATCH}")

# libexl.so: the static library's objects (compiled once, position independent) linked as a shared library.
# While the version is 0.x every minor release may change the ABI, so the soname carries MAJOR.MINOR.
set_target_properties(exl PROPERTIES POSITION_INDEPENDENT_CODE ON)
add_library(exl_shared SHARED $<TARGET_OBJECTS:exl>)
target_link_libraries(exl_shared PRIVATE PkgConfig::CJSON PkgConfig::PCRE2 PkgConfig::UTF8PROC Threads::Threads m
  ${CMAKE_DL_LIBS})
target_link_options(exl_shared PRIVATE -Wl,--no-undefined)
set_target_properties(exl_shared PROPERTIES OUTPUT_NAME exl)
if(NOT SKBUILD) # a wheel holds plain files, no soname links
  set_target_properties(exl_shared PROPERTIES VERSION ${EXL_VERSION} SOVERSION ${EXL_VERSION_MAJOR}.${EXL_VERSION_MINOR})
endif()

# the CLI finds the embedded model beside its installed self, in its install prefix, or in this source tree
target_compile_definitions(exl-cli PRIVATE EXL_SOURCE_DIR="${CMAKE_SOURCE_DIR}"
  EXL_INSTALL_DATADIR="${CMAKE_INSTALL_FULL_DATADIR}")

set(EXL_MODEL_FILES config.json generation_config.json model.safetensors special_tokens_map.json tokenizer.json
  tokenizer_config.json LICENSE README.md)
list(TRANSFORM EXL_MODEL_FILES PREPEND ${CMAKE_SOURCE_DIR}/models/tinystories-656k/)

if(NOT SKBUILD)
  install(TARGETS exl-cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  install(TARGETS exl exl_shared ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(FILES include/exl.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  # exl.pc names the prefix relative to itself, so the prefix given to `cmake --install --prefix` is the one it uses
  file(RELATIVE_PATH EXL_PC_TO_PREFIX ${CMAKE_INSTALL_FULL_LIBDIR}/pkgconfig ${CMAKE_INSTALL_PREFIX})
  configure_file(cmake/exl.pc.in ${CMAKE_BINARY_DIR}/exl.pc @ONLY)
  install(FILES ${CMAKE_BINARY_DIR}/exl.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
  install(FILES ${EXL_MODEL_FILES} DESTINATION ${CMAKE_INSTALL_DATADIR}/exl/models/tinystories-656k)
  if(EXL_CUDA_ENABLED)
    install(TARGETS exl_cuda LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  endif()
else()
  # the wheel: python/exl/ beside libexl.so (loaded with ctypes), the libraries it needs that a Linux system may
  # lack (cJSON, PCRE2, utf8proc: found through the $ORIGIN rpath), the embedded model
  set_target_properties(exl_shared PROPERTIES INSTALL_RPATH "$ORIGIN")
  install(TARGETS exl_shared
    RUNTIME_DEPENDENCIES POST_INCLUDE_REGEXES "cjson|pcre2|utf8proc" POST_EXCLUDE_REGEXES ".*"
    DIRECTORIES ${CJSON_LIBRARY_DIRS} ${PCRE2_LIBRARY_DIRS} ${UTF8PROC_LIBRARY_DIRS}
    LIBRARY DESTINATION exl COMPONENT python)
  install(FILES ${EXL_MODEL_FILES} DESTINATION exl/models/tinystories-656k COMPONENT python)
  if(EXL_CUDA_ENABLED) # -C cmake.define.EXL_CUDA=ON: the wheel builds target exl_shared only, so it pulls exl_cuda
    add_dependencies(exl_shared exl_cuda)
    install(TARGETS exl_cuda LIBRARY DESTINATION exl COMPONENT python)
  endif()
endif()
