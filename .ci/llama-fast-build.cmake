# CI's build of llama-cpp-python (README: the test command passes it as CMAKE_PROJECT_INCLUDE): two cuts in the
# build's compile time (212 s to 137 s on 2 cores) that leave every result localspec reads as it was.
#
# 1. Leave out llama.cpp's `common` library, ~40% of the build's compile time, which llama-cpp-python installs but
#    never loads (its bindings open libllama, libggml* and, for images, libmtmd; localspec uses libmtmd, not
#    common). llama-cpp-python forces the cache entry LLAMA_BUILD_COMMON ON, so -D cannot turn it off; a normal
#    variable set here, after project(), shadows that entry (policy CMP0126, NEW from its cmake_minimum_required
#    3.21).
set(LLAMA_BUILD_COMMON OFF)

# 2. Unity builds where llama.cpp compiles file by file: libmtmd's ~50 sources (one per vision model, each parsing
#    the same headers) and libllama's ~28 core sources (llama.cpp itself already compiles the model files so) become a
#    few translation units; and both libraries at -O1. They hold the host's side (graphs, cells, samplers, the
#    projector's preprocessing); the arithmetic of every matrix is ggml-cpu's, compiled as ever (-O3, file by file).
#    On 2 cores the build took 212 s, 189 s with libmtmd's unity build, 175 s with both, 137 s at -O1
#    (compile-seconds 424, 361, 335, 266); GCC warns of nothing. Neither library is built with FMA contraction or
#    fast-math (those flags stay with ggml-cpu), so no float result can change with what the compiler inlines or how
#    hard it optimizes; decoding the demo pair (speculative, T = 0.7) ran 13.4 against 13.4 tok/s with the -O3 unity
#    build (medians of 8, alternated), the picture tests 55.8 against 55.0 s. Only CI's build does this: the README's
#    other commands build llama.cpp as llama-cpp-python does. The targets exist only once llama-cpp-python's
#    CMakeLists.txt has added them, so the settings are deferred to the end of the directory (this file is included by
#    every project(), ggml's too, where they do nothing). Left out of the unity sources: mtmd-helper*.cpp, a public
#    library's code that #errors when it sees mtmd's internal headers, and llama.cpp and unicode*.cpp, which llama.cpp
#    leaves out.
function(_localspec_unity_sources target pattern skip)
    # SKIP_UNITY_BUILD_INCLUSION = skip on `target`'s sources whose name matches `pattern`, set in the target's own
    # directory (a source file's properties are per directory)
    get_target_property(dir ${target} SOURCE_DIR)
    get_target_property(sources ${target} SOURCES)
    foreach(source IN LISTS sources)
        if(source MATCHES "${pattern}")
            set_source_files_properties("${dir}/${source}" DIRECTORY "${dir}"
                                        PROPERTIES SKIP_UNITY_BUILD_INCLUSION ${skip})
        endif()
    endforeach()
endfunction()

function(_localspec_unity_build)
    if(TARGET mtmd)  # (-DLLAVA_BUILD=OFF: none)
        _localspec_unity_sources(mtmd "mtmd-helper" ON)
        set_target_properties(mtmd PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 16)
        target_compile_options(mtmd PRIVATE -O1)  # (after the build type's -O3: the last -O counts)
    endif()
    if(TARGET llama)  # (already UNITY_BUILD ON for its model files)
        _localspec_unity_sources(llama "^llama-.*[.]cpp$" OFF)
        target_compile_options(llama PRIVATE -O1)
    endif()
endfunction()
cmake_language(DEFER CALL _localspec_unity_build)
