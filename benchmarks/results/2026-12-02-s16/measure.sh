#!/usr/bin/env bash
# End-of-session side-by-side checks of session s16: s15's script (the same parts: w1 sync 1b-w1 w2), with
# base = 3cc83e8 (s15's end) checked out in the worktree /work/base and the outputs under /work/notes/s16/bench.
# Usage: bash measure.sh [parts...]  (this session ran `sync w1`)
O=/work/notes/s16/bench exec bash "$(dirname "$0")/../2026-12-02-s15/measure.sh" "$@"
