# Creates the service user; the unit's StateDirectory creates /var/lib/leasehold.
getent group leasehold >/dev/null || groupadd --system leasehold
getent passwd leasehold >/dev/null || useradd --system --gid leasehold \
    --home-dir /var/lib/leasehold --no-create-home --shell /sbin/nologin leasehold
if command -v systemctl >/dev/null 2>&1; then systemctl daemon-reload || true; fi
