# The two commands of the README: `make demo` and `make test`. Both install what is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Pin the CPU build of torch on this kind of machine; set CONSTRAINTS= to keep your own torch.
CONSTRAINTS ?= -c constraints/cpu.txt

.PHONY: install demo test test-slow lint clean bench-peers bench-peers-avx2 bench-peers-server

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The main job: bring SmolLM2-135M up on an emulated Wormhole whose defaults fail (docs/BRINGUP.md).
# Its own playbook (reports/demo-playbook.json): a second `make demo` tries what worked first.
demo: $(STAMP)
	$(BIN)/firstlight models pull smollm2-135m
	rm -rf reports/demo
	$(BIN)/firstlight bringup --model smollm2-135m --target emulate:wormhole-n300 --out reports/demo \
		--playbook reports/demo-playbook.json --project h100,trn2 --threads 2

# Everything but tests marked slow or device; includes parity on the real SmolLM2-135M and Gemma 3 270M
# (pulled by its test on first use; skipped, with the reason, where the disk has no room for it).
test: $(STAMP)
	$(BIN)/firstlight models pull smollm2-135m
	$(BIN)/python -m pytest -p no:cacheprovider

# The slow tier: real-model checks of every stage (Gemma 3, SmolLM2 on every target, load tests).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider -m slow

# The peers of benchmarks/servers.py, into the same venv: llama.cpp's server through llama-cpp-python,
# compiled here for this CPU (no prebuilt binary is fetched; ~5-30 min on 2 cores), and transformers'
# serving extras. Optional: servers.py skips a peer that is not installed and says so. llama.cpp is built
# first, every time, without pip's wheel cache (a cached wheel, or the installed one, would keep another
# build's ISA); then its dependencies and the rest of the extras.
# bench-peers-avx2: llama.cpp as an AVX2-only CPU runs it (servers.py's docstring: emulating one).
# GGML_OPENMP=OFF: ggml's own thread pool, not OpenMP. llama-cpp-python's server calls llama.cpp from a new
# worker thread per request, and each calling thread gets its own OpenMP team; with two teams alive, libgomp
# counts more threads than cores and its barriers (one per graph node) stop spinning after 100 tries and sleep:
# from the third request on, single-stream decode fell from ~110 to ~45 tok/s with the CPU 40 % idle (its own
# `eval time`, this machine, 2026-12-04). ggml's pool spins regardless of the calling thread.
LLAMA_CPP_ISA ?= -DGGML_NATIVE=ON
LLAMA_CPP_AVX2 := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
bench-peers: $(STAMP)
	CMAKE_ARGS="$(LLAMA_CPP_ISA) -DGGML_OPENMP=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(BIN)/pip install $(CONSTRAINTS) --no-cache-dir --force-reinstall --no-deps --no-binary llama-cpp-python \
		"llama-cpp-python>=0.3.16"
	$(BIN)/pip install $(CONSTRAINTS) -e '.[bench-peers]'

bench-peers-avx2:
	$(MAKE) bench-peers LLAMA_CPP_ISA="$(LLAMA_CPP_AVX2)"

# bench-peers-server: llama.cpp's own `llama-server` (parallel slots, continuous batching), built for this CPU
# from the llama.cpp that llama-cpp-python's source vendors (the same version as bench-peers'), into the venv.
LLAMA_SRC := build/llama-server
bench-peers-server: $(STAMP)
	rm -rf $(LLAMA_SRC) && mkdir -p $(LLAMA_SRC)
	$(BIN)/pip download -q --no-binary :all: --no-deps -d $(LLAMA_SRC) "llama-cpp-python>=0.3.16"
	tar xzf $(LLAMA_SRC)/llama_cpp_python-*.tar.gz -C $(LLAMA_SRC)
	cmake -S $(LLAMA_SRC)/llama_cpp_python-*/vendor/llama.cpp -B $(LLAMA_SRC)/build $(LLAMA_CPP_ISA) \
		-DGGML_OPENMP=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build $(LLAMA_SRC)/build --target llama-server -j 2
	cp $(LLAMA_SRC)/build/bin/llama-server $(BIN)/llama-server

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
