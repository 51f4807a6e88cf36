# The data directory, /var/lib/leasehold, owned by the service user with mode 0750 (what the
# unit's StateDirectory= also asks for); an existing one (an upgrade) is left as it is.
if [ ! -d /var/lib/leasehold ]; then
    install -d -o leasehold -g leasehold -m 0750 /var/lib/leasehold
fi
if command -v systemctl >/dev/null 2>&1; then systemctl daemon-reload >/dev/null 2>&1 || true; fi
exit 0
