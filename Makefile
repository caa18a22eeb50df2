# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# DEVICE=gpu installs faiss-gpu and onnxruntime-gpu instead of the CPU builds (never both).
# TORCH=cpu installs PyTorch's CPU-only wheels from PyTorch's own index first (no CUDA libraries).
# PORT=N serves the demo's app on another port.
PYTHON ?= python3
DEVICE ?= cpu
TORCH ?= default
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
PORT ?= 7860
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --disable-pip-version-check
TEST_EXTRAS := train,test

# A value make does not know is refused, not taken for the default (TORCH=CPU installed the 7 GB CUDA wheel).
ifeq ($(filter $(DEVICE),cpu gpu),)
$(error DEVICE=$(DEVICE): give DEVICE=cpu (the default) or DEVICE=gpu)
endif
ifeq ($(filter $(TORCH),default cpu),)
$(error TORCH=$(TORCH): give TORCH=cpu for PyTorch's CPU-only wheels, or leave TORCH out for its default wheel)
endif

.PHONY: demo test

# The venv is made when its pip is missing, not its python: Debian's python3 without the python3-venv package leaves
# .venv/bin/python behind when it stops, and the venv is made again once the package is installed.
$(BIN)/pip:
	$(PYTHON) -m venv $(VENV)

# PyTorch's default wheel with its CUDA libraries and Triton: 5.3 GB on disk (measured). With less free than that,
# less what .venv holds already, the install cannot finish, so it is refused before pip downloads anything.
TORCH_MB ?= 5300

define install
	@echo "installing retrieval and its $(1) dependencies into $(VENV): about 7 GB with PyTorch's default wheel, whose"
	@echo "CUDA libraries (3.2 GB of it) also run on CPUs; 'make $(2) TORCH=cpu' takes PyTorch's CPU-only wheels instead"
	$(if $(filter cpu,$(TORCH)),$(PIP) $(TORCH_PINS) --index-url $(TORCH_CPU_INDEX),$(call check_disk,$(2)))
	$(PIP) -e ".[$(DEVICE),$(1)]"
	touch $@
endef

define check_disk
	@more=$$(( $(TORCH_MB) - $$(du -sm $(VENV) | cut -f1) )); free=$$(df -Pm $(VENV) | awk 'NR == 2 {print $$4}'); \
	if [ $$free -lt $$more ]; then \
	echo "error: PyTorch's default wheel needs $$more MB more on the disk of $(VENV), which has $$free MB free: free some space, or run 'make $(1) TORCH=cpu' (its CPU-only wheels, without 4 GB of CUDA libraries and Triton)" >&2; \
	exit 2; fi
endef

$(VENV)/.installed-run-$(DEVICE): pyproject.toml | $(BIN)/pip
	$(call install,train,demo)

$(VENV)/.installed-test-$(DEVICE): pyproject.toml | $(BIN)/pip
	$(call install,$(TEST_EXTRAS),test)

demo: $(VENV)/.installed-run-$(DEVICE)
	$(BIN)/retrieval demo --port $(PORT)

test: $(VENV)/.installed-test-$(DEVICE)
	$(BIN)/python -m pytest
