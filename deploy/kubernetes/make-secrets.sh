#!/bin/sh
# Write the Secret inputs an overlay's secretGenerator reads (kept out of git: .gitignore):
#   tokens.env    agent_token, metrics_token (random, 32 bytes hex each)
#   db.env        db_url (evaluation: the bundled PostgreSQL; production: --db-url URL)
#   postgres.env  POSTGRES_PASSWORD (evaluation only)
# Existing files are kept, so running it again rotates nothing.
#   deploy/kubernetes/make-secrets.sh overlays/evaluation
#   deploy/kubernetes/make-secrets.sh overlays/production --db-url 'postgresql+psycopg://gpupool:PW@db.example.org/gpupool'
set -eu
here=$(dirname "$0")
dir=${1:?usage: make-secrets.sh OVERLAY_DIR [--db-url URL]}
case $dir in /*) ;; *) dir=$here/$dir ;; esac
db_url=
if [ "${2:-}" = --db-url ]; then db_url=${3:?--db-url needs a URL}; fi
random() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }
umask 077
if [ ! -f "$dir/tokens.env" ]; then
    printf 'agent_token=%s\nmetrics_token=%s\n' "$(random)" "$(random)" > "$dir/tokens.env"
fi
if [ -f "$dir/postgres.yaml" ]; then  # the evaluation overlay brings its own PostgreSQL
    if [ ! -f "$dir/postgres.env" ]; then
        password=$(random)
        printf 'POSTGRES_PASSWORD=%s\n' "$password" > "$dir/postgres.env"
        printf 'db_url=postgresql+psycopg://gpupool:%s@gpupool-postgres:5432/gpupool\n' "$password" > "$dir/db.env"
    fi
elif [ -n "$db_url" ]; then
    printf 'db_url=%s\n' "$db_url" > "$dir/db.env"
elif [ ! -f "$dir/db.env" ]; then
    echo "make-secrets.sh: $dir needs the store's URL: --db-url 'postgresql+psycopg://USER:PASSWORD@HOST/DB'" >&2
    exit 2
fi
echo "secrets for $dir written (tokens.env, db.env$( [ -f "$dir/postgres.env" ] && echo ', postgres.env'))"
