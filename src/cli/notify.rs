//! systemd's readiness protocol (`sd_notify(3)`), in the few lines it takes: one datagram
//! per state change to the unix socket named by `$NOTIFY_SOCKET`. Under `Type=notify`
//! systemd counts the service as started only on `READY=1`, so that is sent once the data
//! file is open and the listener is bound; `STOPPING=1` marks the start of a drain. Without
//! the variable (not started by systemd) nothing is sent.

use std::ffi::OsStr;
use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Tells systemd `state` (e.g. `READY=1`) if it asked to be told. A failure is logged, not
/// fatal: the server serves either way, and systemd's start timeout reports a missing
/// `READY=1`.
pub fn notify(state: &str) {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = notify_to(&socket, state) {
        tracing::warn!(error = %e, socket = %socket.to_string_lossy(), "cannot notify systemd");
    }
}

/// Sends `state` to the socket at `socket`: a path, or an abstract name written `@name`.
pub fn notify_to(socket: &OsStr, state: &str) -> io::Result<()> {
    let bytes = socket.as_bytes();
    let addr = match bytes.strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name)?,
        None if bytes.first() == Some(&b'/') => SocketAddr::from_pathname(socket)?,
        None => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "NOTIFY_SOCKET is neither an absolute path nor an abstract name (@name)",
            ));
        }
    };
    let sock = UnixDatagram::unbound()?;
    let sent = sock.send_to_addr(state.as_bytes(), &addr)?;
    if sent != state.len() {
        return Err(io::Error::other("the notification was cut short"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_one_datagram_to_a_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let server = UnixDatagram::bind(&path).unwrap();
        notify_to(path.as_os_str(), "READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
    }

    #[test]
    fn sends_to_an_abstract_name() {
        let name = format!("leasehold-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let server = UnixDatagram::bind_addr(&addr).unwrap();
        notify_to(OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let mut buf = [0u8; 64];
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }

    #[test]
    fn refuses_a_relative_path() {
        let err = notify_to(OsStr::new("relative/sock"), "READY=1").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }
}
