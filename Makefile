# Thin wrapper over meson. Every target first installs missing Debian
# packages (scripts/install-deps, silent when none are missing) and
# configures build/ when needed.
BUILD ?= build
MESON_FLAGS ?=

.PHONY: all deps configure test demo bench-plan clean

all: configure
	@ninja --quiet -C $(BUILD)

deps:
	@scripts/install-deps

configure: deps
	@[ -f $(BUILD)/build.ninja ] || meson setup $(BUILD) $(MESON_FLAGS)

test: all
	@meson test -C $(BUILD) --print-errorlogs; status=$$?; \
	  scripts/test-summary $(BUILD)/meson-logs/testlog.json; exit $$status

demo: all
	@scripts/demo $(BUILD)

# Planning speed and memory on the cluster-scale scenarios (needs ../shared).
bench-plan: all
	@scripts/bench-plan $(BUILD)

clean:
	rm -rf $(BUILD)
