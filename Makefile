# Delta weight sync for slime + SGLang. `make demo` and `make test` work on a fresh CPU machine.
PINS      ?= 0.5.15.post1 0.5.23
BUILD     ?= build
PYTEST_ARGS ?=
PIN       ?= 0.5.15.post1
# slime at the pinned commit: a checkout, or (default) the archive extracted under $(BUILD)
SLIME_TARBALL ?= ../shared/upstream/slime-624b824a.tar.gz
SLIME_DIR ?= $(BUILD)/slime
SLIME_COMMIT ?= $(if $(filter $(BUILD)/slime,$(SLIME_DIR)),624b824a898ab0ec1fcb4d373004c7f3852bf515)
STEPS     ?= 5
TRANSPORT ?= disk
ENCODING  ?=
IMAGE     ?= delta-weight-sync:latest

.PHONY: venvs test test-slime slime-tree bench-slime bench-memory bench-pause soak soak-fleet demo bench gpu-check gpu-bundle image image-lint check-image-tree clean

venvs:
	@for p in $(PINS); do scripts/build_venv.sh $$p $(BUILD) || exit 1; done

# One pytest run per SGLang pin: the same tests against both patched versions, except modules whose subject does
# not change with the pin, run with the first only: the wire format, checksum and fingerprint (no SGLang code), the
# package's layout, the bench's report, gpu-check's dry run, the delta tools and the image's tree (our scripts); and
# the soak, 8 syncs per pause mode (both pins' pause modes run in test_pause_modes; `make soak PIN=...` runs 200);
# the sender's logic, pipeline stages and shared-group re-sync (overlay logic; both pins' receivers take disk and
# NCCL deltas in test_server and test_receiver_*); the version store's cases (its server test runs on both pins); the
# docs' claims read from the code; the receiver's fault handling, refusals, write guard, device-path branches and host
# synchronization counts, and the broadcast deadlines (overlay logic: both pins' bindings, loaders and update groups
# run in test_server, test_receiver_*, test_sharded_engines). Later pins leave the sharded engines' bf16 cases to the
# first (their FP8 twins run the same ranks' paths there), and the TP=2 receiver's encodings but the richest
# (tied, xor_ctx in aligned flushes) and the run-length one: the ranks' views are the pin's, the encodings are not;
# and the TP=2 store follower (the catch-up's TP broadcasts are overlay logic; both pins' TP=2 servers take requests
# over the TP group in the training loop case, and both pins' servers follow a store in test_store_server).
# slime's updater runs in `make test-slime` (its own venv: Megatron, Ray).
ONE_PIN_TESTS = tests/test_wire.py tests/test_ctx.py tests/test_checksum.py tests/test_fingerprint.py tests/test_layout.py \
  tests/test_bench.py tests/test_gpu_check.py tests/test_tools.py tests/test_image.py tests/test_soak.py \
  tests/test_pipeline_stages.py tests/test_shared_group_resync.py tests/test_store.py tests/test_docs.py \
  tests/test_fault_matrix.py tests/test_nccl_deadlines.py tests/test_sync_counts.py tests/test_receiver_refusals.py \
  tests/test_write_guard_threads.py tests/test_device_path.py tests/test_sender.py tests/test_store_from_docs.py \
  tests/test_wire_from_docs.py
FIRST_PIN_CASES = $(foreach c,qwen3-moe-None-2-1 qwen3-moe-None-2-2 deepseek-v3-None-2-2 qwen3-moe-None-4-2,\
  tests/test_sharded_engines.py::test_every_rank_of_a_sharded_engine_takes_each_delta_bit_identically[$(c)]) \
  $(foreach c,qwen2-deltas-0 qwen2-xor_zstd-0 qwen2-xor_ctx-0 qwen3-tied-xor_zstd-0,\
  tests/test_receiver_tp2.py::test_tp2_each_rank_narrows_the_global_delta[$(c)]) \
  tests/test_sharded_engines.py::test_a_tp2_server_follows_a_store_whole_versions_staged_while_it_serves
test: venvs
	@rc=0; skip=""; for p in $(PINS); do \
	  echo "=== tests against patched sglang $$p ==="; \
	  $(BUILD)/venv-$$p/bin/python -m pytest tests --ignore=tests/test_slime_sender.py --ignore=tests/test_slime_shard_map.py \
	    --ignore=tests/test_slime_store.py --ignore=tests/test_slime_upstream.py $$skip \
	    $(PYTEST_ARGS) || rc=1; \
	  skip="$(addprefix --ignore=,$(ONE_PIN_TESTS)) $(addprefix --deselect=,$(FIRST_PIN_CASES))"; \
	done; exit $$rc

$(BUILD)/slime/.stamp: $(wildcard $(SLIME_TARBALL))
	@test -f "$(SLIME_TARBALL)" || { echo "make $(MAKECMDGOALS): no slime archive at $(SLIME_TARBALL):" \
	  "pass SLIME_DIR=<slime checked out at 624b824a> or SLIME_TARBALL=<its archive>"; exit 2; }
	rm -rf $(BUILD)/slime && mkdir -p $(BUILD) && tar xzf $(SLIME_TARBALL) -C $(BUILD) && touch $@

# slime at the pinned commit from SLIME_DIR (default: SLIME_TARBALL), patched, and its venv (Megatron, Ray, the image's
# SGLang tree: slime's own SGLang patches, then ours): what test-slime, bench-slime and bench-memory run on.
slime-tree: $(if $(filter $(BUILD)/slime,$(SLIME_DIR)),$(BUILD)/slime/.stamp)
	@test -d "$(SLIME_DIR)/slime" || { echo "make $(MAKECMDGOALS): no slime checkout at $(SLIME_DIR) (SLIME_DIR=...)"; exit 2; }
	@scripts/build_venv.sh 0.5.15.post1 $(BUILD) slime "$(SLIME_DIR)"
	rm -rf $(BUILD)/slime-tree && cp -a "$(SLIME_DIR)" $(BUILD)/slime-tree
	SLIME_COMMIT=$(SLIME_COMMIT) scripts/apply_patches.sh $(BUILD)/slime-tree

# slime's own unit tests of what the patches touch (arguments and their validation, SGLang arguments and config,
# Megatron server arguments and role overrides, external engines, colocated weight buckets, plugin contracts), on the
# pristine and the patched tree; SLIME_UPSTREAM_TESTS=tests runs slime's whole suite both ways.
SLIME_UPSTREAM_TESTS ?= tests/test_megatron_argument_validation.py tests/utils/test_sglang_arguments.py \
  tests/utils/test_sglang_config.py tests/test_sglang_config_mixed_offload.py tests/test_sglang_config_mixed_offload_ft.py \
  tests/utils/test_megatron_server_arguments.py tests/utils/test_megatron_role_config.py \
  tests/test_external_sglang_engines.py tests/test_empty_colocated_weight_bucket.py tests/plugin_contracts

# slime's patched updater with a tiny Megatron model on CPU into a server on the image's SGLang tree; then slime's own
# tests, pristine against patched (a test that passes pristine must pass patched, or be an intended difference listed
# in docs/compatibility.md).
test-slime: slime-tree
	SLIME_PATCHED_DIR=$(abspath $(BUILD)/slime-tree) SLIME_PRISTINE_DIR=$(abspath $(SLIME_DIR)) \
	  PYTHONPATH=$(abspath $(BUILD)/slime-tree) \
	  $(BUILD)/venv-0.5.15.post1-slime/bin/python -m pytest tests/test_slime_sender.py tests/test_slime_shard_map.py \
	  tests/test_slime_store.py tests/test_slime_upstream.py $(PYTEST_ARGS)
	$(BUILD)/venv-0.5.15.post1-slime/bin/python scripts/upstream_suite.py --pristine $(SLIME_DIR) \
	  --patched $(BUILD)/slime-tree $(SLIME_UPSTREAM_TESTS)

# slime's own disk delta (xor, overwrite) and ours (deltas_zstd, planes_zstd, xor_zstd) on the same Megatron steps
# into a real server, side by side -> a section of docs/benchmarks.md (same slime checkout as test-slime).
BENCH_SLIME_ARGS ?=
bench-slime: slime-tree
	PYTHONPATH=$(abspath $(BUILD)/slime-tree) \
	  $(BUILD)/venv-0.5.15.post1-slime/bin/python scripts/bench_slime.py --workdir $(BUILD)/bench-slime $(BENCH_SLIME_ARGS)

# The peak tensor memory of every transient of a sync (shard map build, sharded diff, sender flush, engine apply,
# xor rebuild, full sync, fingerprint) against the reference that bounds it, at two model depths: one line per
# component on stdout, and a section of docs/benchmarks.md; fails if one is OVER its budget or grows with the model.
BENCH_MEMORY_ARGS ?=
bench-memory: slime-tree
	PYTHONPATH=$(abspath $(BUILD)/slime-tree) \
	  $(BUILD)/venv-0.5.15.post1-slime/bin/python scripts/bench_memory.py --workdir $(BUILD)/bench-memory $(BENCH_MEMORY_ARGS)

demo:
	@scripts/build_venv.sh $(PIN) $(BUILD)
	$(BUILD)/venv-$(PIN)/bin/python scripts/demo.py --workdir $(BUILD)/demo --steps $(STEPS) --transport $(TRANSPORT) $(if $(ENCODING),--encoding $(ENCODING))

# Full sync vs delta on a Qwen2.5-0.5B-shaped model: wire bytes, sender vs memcpy, apply vs load_weights,
# modeled sync time, peak memory -> docs/benchmarks.md + docs/benchmarks.png (BENCH_ARGS="--steps 5" etc.); then the
# version store on the same states (a late joiner's catch-up vs a full sync, upload vs engines, compaction); then
# every encoding side by side with slime's and the published formats, and the entropy floors (bench_coding.py).
BENCH_ARGS ?=
bench:
	@scripts/build_venv.sh $(PIN) $(BUILD)
	$(BUILD)/venv-$(PIN)/bin/python scripts/bench.py --workdir $(BUILD)/bench $(BENCH_ARGS)
	$(BUILD)/venv-$(PIN)/bin/python scripts/bench_store.py --workdir $(BUILD)/bench $(BENCH_ARGS)
	$(BUILD)/venv-$(PIN)/bin/python scripts/bench_coding.py --workdir $(BUILD)/bench $(BENCH_ARGS)

# How long generation stands still while a store follower takes a version (root: a network namespace and tc tbf
# emulate the link): a real CPU server, a streaming client, a directory store and S3 at 200 and 20 Mbit/s, each with
# and without staging -> one `pause:` line per case and a section of docs/benchmarks.md.
BENCH_PAUSE_ARGS ?=
bench-pause:
	@scripts/build_venv.sh $(PIN) $(BUILD)
	$(BUILD)/venv-$(PIN)/bin/python scripts/bench_pause.py --workdir $(BUILD)/bench-pause $(BENCH_PAUSE_ARGS)

# On a GPU host: the CUDA sender and receiver paths checked and measured (scripts/gpu_check.py; exits 2 without
# CUDA). Where SGLang is not installed it runs from build/gpu-bundle/site.zip (`make gpu-bundle` on a machine
# with PyPI access; carry build/gpu-bundle along).
GPU_PYTHON ?= python3
GPU_REPORT ?= $(BUILD)/gpu-check/report.md
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py --bundle $(BUILD)/gpu-bundle/site.zip --report $(GPU_REPORT)

gpu-bundle: $(if $(filter $(BUILD)/slime,$(SLIME_DIR)),$(BUILD)/slime/.stamp)
	SLIME_COMMIT=$(SLIME_COMMIT) scripts/gpu_bundle.sh $(BUILD) "$(SLIME_DIR)"

# 200 syncs per pause mode into a real server serving generation traffic, with random (seeded) faults (`make test`
# runs 8), one `soak:` line per mode; and the disk transport's fan-out to four real servers.
soak:
	@scripts/build_venv.sh $(PIN) $(BUILD)
	SOAK_SYNCS=200 $(BUILD)/venv-$(PIN)/bin/python -m pytest tests/test_soak.py tests/test_disk_fanout.py -s $(PYTEST_ARGS)

# A fleet on a version store (SeaweedFS, then a directory): real servers join, leave and restart at random, store
# faults and attacks mixed in, generation traffic throughout; one `fleet:` line per store kind.
FLEET_SYNCS ?= 60
soak-fleet:
	@scripts/build_venv.sh $(PIN) $(BUILD)
	FLEET_SYNCS=$(FLEET_SYNCS) $(BUILD)/venv-$(PIN)/bin/python -m pytest tests/test_soak_fleet.py -s $(PYTEST_ARGS)

# The container image: slime's published image with our patches applied (needs a Docker engine; see README).
image:
	docker build -f docker/Dockerfile -t $(IMAGE) .

# hadolint on the Dockerfile, shellcheck on every shell script (no Docker engine needed).
image-lint: $(BUILD)/venv-lint/.stamp
	$(BUILD)/venv-lint/bin/hadolint docker/Dockerfile
	$(BUILD)/venv-lint/bin/shellcheck scripts/*.sh docker/*.sh

$(BUILD)/venv-lint/.stamp: requirements/lint.txt
	rm -rf $(BUILD)/venv-lint && python3 -m venv $(BUILD)/venv-lint
	$(BUILD)/venv-lint/bin/pip install -q --disable-pip-version-check -r requirements/lint.txt 2>&1 | { grep -v "Location .* is ignored" || true; }
	touch $@

# Rebuild the image's SGLang tree (0.5.15.post1 wheel + slime's `latest` patches) and check ours on top.
check-image-tree: $(if $(filter $(BUILD)/slime,$(SLIME_DIR)),$(BUILD)/slime/.stamp)
	@test -d "$(SLIME_DIR)/slime" || { echo "make check-image-tree: no slime checkout at $(SLIME_DIR) (SLIME_DIR=...)"; exit 2; }
	scripts/check_image_tree.sh "$(SLIME_DIR)" $(BUILD)/image-tree

clean:
	rm -rf $(BUILD)
