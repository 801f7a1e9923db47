# CI's build of llama-cpp-python (README: the test command passes it as CMAKE_PROJECT_INCLUDE): two cuts in the
# build's compile time that change nothing localspec loads.
#
# 1. Leave out llama.cpp's `common` library, ~40% of the build's compile time, which llama-cpp-python installs but
#    never loads (its bindings open libllama, libggml* and, for images, libmtmd; localspec uses libmtmd, not
#    common). llama-cpp-python forces the cache entry LLAMA_BUILD_COMMON ON, so -D cannot turn it off; a normal
#    variable set here, after project(), shadows that entry (policy CMP0126, NEW from its cmake_minimum_required
#    3.21).
set(LLAMA_BUILD_COMMON OFF)

# 2. Compile libmtmd as a unity build, as llama.cpp already compiles libllama's model files: its ~50 sources (one
#    per vision model, each parsing the same headers) become a few, 127 compile-seconds down to 76 here (the whole
#    build: 212 s to 189 s on 2 cores). The target exists only after llama-cpp-python's CMakeLists.txt has added
#    tools/mtmd, so the setting is deferred to the end of the top directory. mtmd-helper*.cpp stay out of the unity
#    sources: they are a public library's code and #error when they see mtmd's internal headers.
function(_localspec_unity_build_mtmd)
    if(NOT TARGET mtmd)  # (-DLLAVA_BUILD=OFF)
        return()
    endif()
    get_target_property(mtmd_dir mtmd SOURCE_DIR)
    get_target_property(mtmd_sources mtmd SOURCES)
    foreach(source IN LISTS mtmd_sources)
        if(source MATCHES "mtmd-helper")
            set_source_files_properties("${mtmd_dir}/${source}" DIRECTORY "${mtmd_dir}"
                                        PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
        endif()
    endforeach()
    set_target_properties(mtmd PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 16)
endfunction()
cmake_language(DEFER CALL _localspec_unity_build_mtmd)
