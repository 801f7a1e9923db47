# CI's build of llama-cpp-python (README: the test command passes it as CMAKE_PROJECT_INCLUDE): leave out
# llama.cpp's `common` library, ~40% of the build's compile time, which llama-cpp-python installs but never loads
# (its bindings open libllama, libggml* and, for images, libmtmd; localspec uses libmtmd, not common).
# llama-cpp-python forces the cache entry LLAMA_BUILD_COMMON ON, so -D cannot turn it off; a normal variable set
# here, after project(), shadows that entry (policy CMP0126, NEW from its cmake_minimum_required 3.21).
set(LLAMA_BUILD_COMMON OFF)
