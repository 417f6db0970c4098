#!/usr/bin/env bash
# Starts a throw-away PostgreSQL server for the tests and benches: a fresh
# cluster in a temporary directory, listening on 127.0.0.1 at a free port,
# trust authentication for the local superuser. Prints the URL to pass as
# MLXNET_TEST_DATABASE_URL (each test creates its own database on it).
#
#   export MLXNET_TEST_DATABASE_URL=$(scripts/pg-test-server.sh)
#   scripts/pg-test-server.sh stop DIR      # stops the server started in DIR, removes DIR
#   scripts/pg-test-server.sh restart DIR   # kills it (immediate mode) and starts it again
#
# PostgreSQL refuses to run as root: as root the cluster belongs to (and the
# server runs as) the `postgres` user, created if missing. The binaries are
# found on PATH, else under /usr/lib/postgresql/<newest>/bin. Fsync stays on
# (the default), as in production: benches measure durable commits.
# Writes the directory to $PGTEST_DIR_FILE when set (for the caller to stop
# the server later); the log is DIR/log.
set -euo pipefail

bindir() {
  if command -v pg_ctl >/dev/null 2>&1; then
    dirname "$(command -v pg_ctl)"
    return
  fi
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
  [ -n "$d" ] || { echo "pg-test-server: no PostgreSQL binaries (install postgresql)" >&2; exit 1; }
  echo "$d"
}
BIN=$(bindir)

as_owner() {
  if [ "$(id -u)" = 0 ]; then
    # -s: the postgres user's shell may be nologin.
    su postgres -s /bin/sh -c "$(printf '%q ' "$@")"
  else
    "$@"
  fi
}

if [ "${1:-}" = stop ]; then
  dir=${2:?usage: pg-test-server.sh stop DIR}
  # Only a directory this script made (its cluster inside) is removed.
  [ -f "$dir/data/PG_VERSION" ] || { echo "pg-test-server: $dir holds no cluster" >&2; exit 1; }
  as_owner "$BIN/pg_ctl" -D "$dir/data" -m fast stop >/dev/null
  rm -rf "$dir"
  exit 0
fi

if [ "${1:-}" = restart ]; then
  dir=${2:?usage: pg-test-server.sh restart DIR}
  [ -f "$dir/data/PG_VERSION" ] || { echo "pg-test-server: $dir holds no cluster" >&2; exit 1; }
  # Immediate: no clean shutdown, as a crash; -w waits until it accepts again.
  as_owner "$BIN/pg_ctl" -D "$dir/data" -m immediate -w -l "$dir/log" restart >/dev/null
  exit 0
fi

if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
  useradd --system --no-create-home --shell /usr/sbin/nologin postgres
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/mlxnet-pg.XXXXXX")
chmod 755 "$dir"
[ "$(id -u)" = 0 ] && chown postgres "$dir"
user=$([ "$(id -u)" = 0 ] && echo postgres || id -un)

as_owner "$BIN/initdb" -D "$dir/data" -U "$user" --auth=trust --no-sync -E UTF8 >"$dir/initdb.log" 2>&1 \
  || { cat "$dir/initdb.log" >&2; exit 1; }

# A free port: ask the kernel for one, then start on it (retry if taken meanwhile).
for _ in 1 2 3 4 5; do
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  if as_owner "$BIN/pg_ctl" -D "$dir/data" -l "$dir/log" -w -t 60 \
      -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c max_connections=300 -c shared_buffers=128MB" \
      start >/dev/null 2>&1; then
    [ -n "${PGTEST_DIR_FILE:-}" ] && echo "$dir" >"$PGTEST_DIR_FILE"
    echo "postgres://$user@127.0.0.1:$port/postgres"
    exit 0
  fi
done
cat "$dir/log" >&2
exit 1
