# Thin wrapper over meson. Every target first installs missing Debian
# packages (scripts/install-deps, silent when none are missing) and
# configures build/ when needed.
BUILD ?= build
MESON_FLAGS ?=
# ccache (when installed) hashes the paths inside the repository relative
# to it and leaves the build folder's path out, so another clone (CI's
# fresh one) reuses what an earlier clone compiled.
export CCACHE_BASEDIR ?= $(CURDIR)
export CCACHE_NOHASHDIR ?= true

.PHONY: all deps configure test demo bench-plan fuzz clean

all: configure
	@ninja --quiet -C $(BUILD)

deps:
	@scripts/install-deps

configure: deps
	@[ -f $(BUILD)/build.ninja ] || meson setup $(BUILD) $(MESON_FLAGS)

test: all
	@meson test -C $(BUILD) --print-errorlogs; status=$$?; \
	  scripts/test-summary $(BUILD)/meson-logs/testlog.json; exit $$status

# Plans the shipped scenarios (one table), then refreshes tp2-to-tp2x2 live with
# refit-bench: one process per rank, 3 versions, every byte verified.
demo: all
	@scripts/demo $(BUILD)

# Planning speed and memory on the cluster-scale scenarios (needs ../shared).
bench-plan: all
	@scripts/bench-plan $(BUILD)

# libFuzzer over the control plane's frame decoder and message parsers, for
# FUZZ_SECONDS (default 60), in a clang build of its own (build-fuzz/),
# through ccache when it is installed (meson adds it only to the compilers
# it finds itself, not to one named in CXX). libFuzzer's progress goes to
# build-fuzz/fuzz.log (a line per new input: thousands a minute, which
# pushed everything after it out of CI's tail); the final stats are
# printed, or the log's last 60 lines when it fails.
FUZZ_SECONDS ?= 60
fuzz: deps
	@scripts/install-deps --fuzz
	@[ -f build-fuzz/build.ninja ] || CXX="$$(command -v ccache >/dev/null && echo 'ccache ')clang++" \
	  meson setup build-fuzz -Dfuzz=enabled -Dtests=true
	@ninja --quiet -C build-fuzz tests/transport/control/control_fuzz
	@mkdir -p build-fuzz/corpus
	@build-fuzz/tests/transport/control/control_fuzz -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 \
	  -print_final_stats=1 build-fuzz/corpus >build-fuzz/fuzz.log 2>&1; status=$$?; \
	  if [ $$status -eq 0 ]; then grep -E '^(#[0-9]+[[:space:]]+DONE|stat::)' build-fuzz/fuzz.log; \
	  else tail -n 60 build-fuzz/fuzz.log; echo "make fuzz: libFuzzer exited with $$status; its whole log is build-fuzz/fuzz.log" >&2; fi; \
	  exit $$status

clean:
	rm -rf $(BUILD) build-fuzz
