# Creates the service user before the files land, so that %post can give it the data directory.
getent group leasehold >/dev/null || groupadd --system leasehold
getent passwd leasehold >/dev/null || useradd --system --gid leasehold \
    --home-dir /var/lib/leasehold --no-create-home --shell /sbin/nologin \
    --comment "Leasehold lease and lock appliance" leasehold
exit 0
