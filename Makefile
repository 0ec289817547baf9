# feature_outbox: `make demo` runs the main job on real data; `make test` runs every test.
# Both install what is missing first (scripts/setup.sh), so a fresh Debian 12 machine needs nothing else.
#
# PG=N picks the PostgreSQL major: 15 (the default) is the host's Debian 12 server; 17 and 18 run
# the same target inside that major's Debian root (scripts/pgroot.sh makes it on first use), where
# scripts/pgroot.sh sets FEATURE_OUTBOX_PG=N and this Makefile runs again. Examples:
#   make test PG=18     make demo PG=17     make bench PG=18     make package PG=17

PG ?= $(or $(FEATURE_OUTBOX_PG),15)
PG_CONFIG ?= /usr/lib/postgresql/$(PG)/bin/pg_config
PGRX_PGDATA ?= /var/tmp/feature_outbox_pgrx$(filter-out 15,$(PG))
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
# Passed on into a root: pytest's arguments (make pg-test PYTEST_ARGS='-k relay') and the demo's.
PASS_ON := PYTEST_ARGS DEMO_LIMIT DEMO_SKIP_INSTALL DEMO_TIMEOUT BENCH_REPEATS
PASS_ON_ARGS = $(foreach v,$(PASS_ON),$(if $(value $(v)),$(v)='$(value $(v))'))
VENV := $(or $(FEATURE_OUTBOX_VENV),.venv)

.PHONY: docs setup build install install-test test unit-test pg-test demo bench bench-steps bench-ab faults package package-test clean

ifneq ($(PG),15)
ifneq ($(FEATURE_OUTBOX_PG),$(PG))
ROOTED := 1
endif
endif

ifdef ROOTED
# Outside the root of major PG: each target runs again inside it.
setup build install install-test test unit-test pg-test demo bench bench-ab faults package:
	$(SUDO) bash scripts/pgroot.sh run $(PG) make $@ PG=$(PG) $(PASS_ON_ARGS)
else
setup:
	bash scripts/setup.sh

build: setup
	cargo build --release --no-default-features --features pg$(PG)

## install: the release extension into the Debian PostgreSQL of major PG, each file renamed into place so
## running servers keep the library they loaded.
install: setup
	PG_CONFIG=$(PG_CONFIG) bash scripts/install.sh release

## install-test: the debug build with the fault-injection point the relay tests use.
install-test: setup
	PG_CONFIG=$(PG_CONFIG) bash scripts/install.sh debug fault-injection

## unit-test: pure-Rust unit tests and #[pg_test]s, in a throwaway cluster run as the postgres user.
unit-test: setup
	$(SUDO) install -d -o postgres -g postgres $(PGRX_PGDATA)
	cargo pgrx test pg$(PG) --runas postgres --pgdata $(PGRX_PGDATA)

## pg-test: SQL regression files and the end-to-end harness (real data, NATS, HTTP) in pg_test/.
pg-test: install-test
	bash pg_test/run.sh $(PYTEST_ARGS)

## test: every test, then the release build back in place of the debug one the tests installed.
test: unit-test pg-test
	PG_CONFIG=$(PG_CONFIG) bash scripts/install.sh release
	@echo "make test: the release build of feature_outbox is installed again (the tests ran a debug build); restart servers to load it"

demo: setup
	bash demo/run.sh

## bench: the release build with the test-only discard:// sink (the in-worker floor), then the
## plain release build back in place.
bench: setup
	PG_CONFIG=$(PG_CONFIG) bash scripts/install.sh release fault-injection
	bash bench/run.sh
	PG_CONFIG=$(PG_CONFIG) bash scripts/install.sh release

## bench-steps: make bench's section 15 alone (bench/edit_steps.py): callgrind instructions per edit_feature call by
## step, beside the floor's. FEATURE_OUTBOX_STEPS_BINS=label=bin_dir adds another tree, e.g. one bench/ab_setup.sh made.
bench-steps: setup
	PG_CONFIG=$(PG_CONFIG) bash scripts/install.sh release fault-injection
	$(VENV)/bin/python bench/edit_steps.py
	PG_CONFIG=$(PG_CONFIG) bash scripts/install.sh release

## bench-ab: make bench's section 16 alone: this build against a release side by side in one run (default: the last
## in sql/released/RELEASES), every edit, relay and instruction figure with its ratio to the release's and a mark where
## this build is more than 3 % worse. The release's tree is built once (bench/ab_setup.sh, target/ab). AB_LABEL=0.3.0
## compares against another release; AB_COMMIT=<sha> AB_LABEL=<name> against any commit. Output: bench/AB-<label>.md
## (bench/AB.md for 0.2.0, issue 20's run).
AB_LABEL ?= $(word 1,$(shell bash scripts/releases.sh last))
AB_OUT = $(if $(filter 0.2.0,$(AB_LABEL)),bench/AB.md,bench/AB-$(AB_LABEL).md)
bench-ab: setup
	PG_CONFIG=$(PG_CONFIG) bash scripts/install.sh release fault-injection
	bin=$$(bash bench/ab_setup.sh $(or $(AB_COMMIT),$(AB_LABEL))) && \
	  FEATURE_OUTBOX_AB_BIN=$$bin FEATURE_OUTBOX_AB_LABEL=$(AB_LABEL) $(VENV)/bin/python bench/ab_bench.py | tee $(AB_OUT)
	PG_CONFIG=$(PG_CONFIG) bash scripts/install.sh release

## faults: every fault drill in full (JetStream cluster, failover, outages, hostile receivers),
## against Debian's nats-server and PyPI's current one; writes pg_test/FAULTS.md. make test runs
## each drill in its short form. Then the alert rules end to end with the shipped thresholds
## (pg_test/test_prometheus.py, about 15 minutes), and the Patroni failover drill in full: Debian's
## Patroni 3.0 and PyPI's 4.1.5, each gate of issue 54 the build has, 10 runs each with the pause
## and the kill at random points; writes pg_test/PATRONI.md (about 1.5 minutes a run).
faults: install-test
	$(VENV)/bin/python pg_test/faults.py
	$(VENV)/bin/python pg_test/failover_drills.py 10
	FEATURE_OUTBOX_ALERTS_FULL=1 bash pg_test/run.sh pg_test/test_prometheus.py
	$(VENV)/bin/python pg_test/patroni_drills.py

## package: dist/postgresql-$(PG)-feature-outbox_<version>-1_amd64.deb, built in that major's root
## (15: on the host, which is that root's Debian 12).
package: setup
	PG_CONFIG=$(PG_CONFIG) bash scripts/package.sh

endif

## package-test (on the host, any PG): the packages of major PG installed in a clean root of its
## Debian release (no Rust, no compiler): the README's quick start, the 0.2.0 package upgraded with
## waiting events, and a pg_dump from 15 restored. Needs make package PG=$(PG) first.
package-test:
	bash scripts/package_test.sh $(PG)

clean:
	cargo clean

## docs: the book (docs/, mdBook) into target/book; installs mdbook 0.5.4 first when missing.
docs:
	bash scripts/docs.sh
