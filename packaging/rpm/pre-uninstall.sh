# On removal ($1 = 0), stop and disable the service; on upgrade ($1 = 1) leave it running.
if [ "$1" = 0 ] && command -v systemctl >/dev/null 2>&1; then
    systemctl --no-reload disable --now leasehold.service >/dev/null 2>&1 || true
fi
