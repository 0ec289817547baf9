# feature_outbox: `make demo` runs the main job on real data; `make test` runs every test.
# Both install what is missing first (scripts/setup.sh), so a fresh Debian 12 machine needs nothing else.

PG_CONFIG ?= /usr/lib/postgresql/15/bin/pg_config
PGRX_PGDATA ?= /var/tmp/feature_outbox_pgrx
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: setup build install install-test test unit-test pg-test demo bench bench-ab faults clean

setup:
	bash scripts/setup.sh

build: setup
	cargo build --release

## install: the release extension into the Debian PostgreSQL 15, each file renamed into place so
## running servers keep the library they loaded.
install: setup
	PG_CONFIG=$(PG_CONFIG) bash scripts/install.sh release

## install-test: the debug build with the fault-injection point the relay tests use.
install-test: setup
	PG_CONFIG=$(PG_CONFIG) bash scripts/install.sh debug fault-injection

## unit-test: pure-Rust unit tests and #[pg_test]s, in a throwaway cluster run as the postgres user.
## PG=17 or PG=18: the same against that major, inside its Debian root (scripts/pgroot.sh makes it
## on first use, ~4 min, then the build ~8 min). The rest of make test on 17 and 18 is still to come.
PG ?= 15
ifeq ($(PG),15)
unit-test: setup
	$(SUDO) install -d -o postgres -g postgres $(PGRX_PGDATA)
	cargo pgrx test pg15 --runas postgres --pgdata $(PGRX_PGDATA)
else
unit-test:
	$(SUDO) bash scripts/pgroot.sh run $(PG) bash -c 'cargo pgrx init --pg$(PG) "$$PG_CONFIG" >/dev/null \
	  && install -d -o postgres -g postgres $(PGRX_PGDATA)$(PG) \
	  && cargo pgrx test pg$(PG) --runas postgres --pgdata $(PGRX_PGDATA)$(PG)'
endif

## pg-test: SQL regression files and the end-to-end harness (real data, NATS, HTTP) in pg_test/.
pg-test: install-test
	bash pg_test/run.sh

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

## bench-ab: this build against 0.2.0 (its release commit), side by side: the bigint edit path and
## the relay, each as a ratio to its floor. Builds 0.2.0 into a copy of the PostgreSQL tree first.
bench-ab: setup
	PG_CONFIG=$(PG_CONFIG) bash scripts/install.sh release fault-injection
	FEATURE_OUTBOX_AB_BIN=$$(bash bench/ab_setup.sh 4bc42654f1b92a2e0b2c580995f0eefbce8c1de0 /opt/pg-0.2.0) \
	  FEATURE_OUTBOX_AB_LABEL=0.2.0 .venv/bin/python bench/ab_bench.py | tee bench/AB.md
	PG_CONFIG=$(PG_CONFIG) bash scripts/install.sh release

## faults: every fault drill in full (JetStream cluster, failover, outages, hostile receivers),
## against Debian's nats-server and PyPI's current one; writes pg_test/FAULTS.md. make test runs
## each drill in its short form.
faults: install-test
	.venv/bin/python pg_test/faults.py

clean:
	cargo clean
