# shellcheck shell=sh
# bounded.sh: runs a command on a remote host under a time limit. Sent as
# `sh -c "$(cat bounded.sh)" genv-enforce LIMIT COMMAND [ARG...]`: nothing
# is installed on the host. POSIX sh; `timeout` from coreutils or busybox.
#
# Arguments: LIMIT, whole seconds; then the command and its arguments
#   (our constants and the inventory's sudo/python words, never host data).
# Output: the command's, untouched.
# Exit: the command's status; 124 when it ran past LIMIT and was stopped,
#   137 when it had to be killed one second after that. Without `timeout`
#   on the host the command runs unbounded (our own deadline still ends
#   the wait for it).
l=$1
shift
if command -v timeout >/dev/null 2>&1; then
    exec timeout -k 1 "$l" "$@"
fi
exec "$@"
