# After an upgrade ($1 >= 1), restart a running service onto the new binary.
if command -v systemctl >/dev/null 2>&1; then
    systemctl daemon-reload >/dev/null 2>&1 || true
    if [ "$1" -ge 1 ]; then
        systemctl try-restart leasehold.service >/dev/null 2>&1 || true
    fi
fi
