//! A remote shell for the two guests (hidden commands `__rsh-server PORT` and `__rsh HOST CMD...`):
//! what Open MPI's `mpirun` needs to start its daemons in the other guest (`plm_rsh_agent`), with
//! no sshd, keys or users in the guests. Only for the harness's private link.
//!
//! The client sends the command as one line (its arguments joined by spaces, as ssh does: Open MPI
//! quotes what the remote shell must see as one word); the server runs it with `sh -c` in a new
//! process group, stdout and stderr to the connection, and kills the group when the connection
//! closes (the client was killed: `mpirun` ends its agents so). The client copies the connection
//! to its stdout and exits with the status the server sends last (`\0EXIT n\n`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::thread;

/// Where the server listens.
pub const PORT: u16 = 2222;

/// `__rsh-server PORT`: serves connections until killed.
pub fn server(port: u16) -> u8 {
    let listener = match TcpListener::bind(("0.0.0.0", port)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("rsh-server: listening on {port}: {e}");
            return 1;
        }
    };
    for conn in listener.incoming().flatten() {
        thread::spawn(move || serve(conn));
    }
    0
}

fn serve(conn: TcpStream) {
    let mut reader = BufReader::new(match conn.try_clone() {
        Ok(c) => c,
        Err(_) => return,
    });
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() || line.trim().is_empty() {
        return;
    }
    let (Ok(out), Ok(err)) = (conn.try_clone(), conn.try_clone()) else { return };
    let child = Command::new("/bin/sh")
        .arg("-c")
        .arg(line.trim_end())
        .stdin(Stdio::null())
        .stdout(Stdio::from(std::os::fd::OwnedFd::from(out)))
        .stderr(Stdio::from(std::os::fd::OwnedFd::from(err)))
        .process_group(0)
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            let _ = (&conn).write_all(format!("rsh-server: {e}\n\0EXIT 127\n").as_bytes());
            return;
        }
    };
    let pgid = child.id() as i32;
    // The connection closing (the client gone) kills the command's process group.
    let watcher = {
        let mut r = reader;
        thread::spawn(move || {
            let mut buf = [0u8; 64];
            while matches!(r.read(&mut buf), Ok(n) if n > 0) {}
            // SAFETY: kill(2) on a process group id of our own child; no memory involved.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        })
    };
    let code = child.wait().map(|s| s.code().unwrap_or(128 + 9)).unwrap_or(1);
    let _ = (&conn).write_all(format!("\0EXIT {code}\n").as_bytes());
    let _ = conn.shutdown(std::net::Shutdown::Both);
    let _ = watcher.join();
}

/// `__rsh HOST CMD...`: runs CMD on HOST's server.
pub fn client(host: &str, cmd: &[String]) -> u8 {
    let mut conn = match TcpStream::connect((host, PORT)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rsh: {host}:{PORT}: {e}");
            return 255;
        }
    };
    let line = format!("{}\n", cmd.join(" ").replace('\n', " "));
    if conn.write_all(line.as_bytes()).is_err() {
        return 255;
    }
    let mut out = std::io::stdout();
    let mut buf = [0u8; 8192];
    let mut tail: Vec<u8> = Vec::new();
    loop {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                tail.extend_from_slice(&buf[..n]);
                // Keep back what may be the start of the status trailer.
                let keep = tail.iter().rposition(|&b| b == 0).unwrap_or(tail.len());
                let _ = out.write_all(&tail[..keep]);
                let _ = out.flush();
                tail.drain(..keep);
            }
        }
    }
    let text = String::from_utf8_lossy(&tail);
    text.trim_start_matches('\0')
        .strip_prefix("EXIT ")
        .and_then(|c| c.trim().parse::<u8>().ok())
        .unwrap_or(255)
}
