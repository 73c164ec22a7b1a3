//! The pingpong and perf examples take device, port, GID index, timeout and retry count from
//! `IBVERBS_*`/`NCCL_IB_*` when their own flags are absent, and their flags win. Runs the
//! examples from `target/<profile>/examples/` (build them first) under `env`, over
//! `IBVERBS_TEST_DEVICE` (default rxe0) and `IBVERBS_TEST_GID_INDEX` (default 1).

mod examples_support;

use std::time::Duration;

use examples_support::*;

/// `env` with the selection variables of the harness cleared, then `vars`, then the example.
fn with_env(vars: &[String], tool: &str, args: &[&str]) -> Vec<String> {
    let mut v: Vec<String> =
        ["-u", "IBVERBS_HCA", "-u", "IBVERBS_GID_INDEX", "-u", "NCCL_IB_HCA", "-u", "NCCL_IB_GID_INDEX"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    v.extend(vars.iter().cloned());
    v.push(example(tool).to_string_lossy().into_owned());
    v.extend(args.iter().map(|s| s.to_string()));
    v
}

fn pair(tool: &str, vars: &[String], args: &[&str], port: u16) -> (Finished, Finished) {
    let port_s = port.to_string();
    let mut server_args = args.to_vec();
    server_args.extend(["-p", &port_s]);
    let server = start_server(&"env".into(), &with_env(vars, tool, &server_args), port);
    let mut client_args = server_args.clone();
    client_args.push("127.0.0.1");
    let client = Running::spawn("env", &with_env(vars, tool, &client_args)).finish(RUN_TIMEOUT);
    let server = server.finish(RUN_TIMEOUT);
    client.assert_success();
    server.assert_success();
    (client, server)
}

#[test]
fn pingpongs_take_device_and_gid_from_nccl_variables() {
    require_device();
    let vars = [
        format!("NCCL_IB_HCA={}", device()),
        format!("NCCL_IB_GID_INDEX={}", gid_index()),
        "NCCL_IB_TIMEOUT=16".to_string(),
        "NCCL_IB_RETRY_CNT=5".to_string(),
    ];
    pair("rc_pingpong", &vars, &["-n", "20"], 18960);
    // The GID index really comes from the variable: index 0 is rxe's link-local GID, which the
    // automatic choice (RoCE v2 IPv4) never picks; and -g wins over it.
    let zero = [format!("NCCL_IB_HCA={}", device()), "NCCL_IB_GID_INDEX=0".to_string()];
    let (client, _) = pair("rc_pingpong", &zero, &["-n", "5"], 18966);
    assert!(client.stdout.contains("GID fe80:"), "{}", client.describe());
    let (client, _) = pair("rc_pingpong", &zero, &["-n", "5", "-g", &gid_index()], 18967);
    assert!(!client.stdout.contains("GID fe80:"), "{}", client.describe());
    pair("ud_pingpong", &vars, &["-n", "20", "-s", "512"], 18961);
}

#[test]
fn perf_examples_take_device_and_gid_from_our_variables() {
    require_device();
    let vars = [format!("IBVERBS_HCA={}", device()), format!("IBVERBS_GID_INDEX={}", gid_index())];
    pair("write_bw", &vars, &["-s", "4096", "-n", "50"], 18962);
    pair("send_lat", &vars, &["-n", "50"], 18963);
}

#[test]
fn flags_win_over_a_bad_environment_device() {
    require_device();
    let vars = ["NCCL_IB_HCA=nosuch".to_string()];
    let (dev, gid) = (device(), gid_index());
    pair("rc_pingpong", &vars, &["-d", &dev, "-g", &gid, "-n", "20"], 18964);
    pair("read_bw", &vars, &["-d", &dev, "-x", &gid, "-s", "4096", "-n", "50"], 18965);
}

#[test]
fn environment_errors_name_the_variable_and_fail_fast() {
    require_device();
    let quick = Duration::from_secs(20);
    let dev = device();
    let cases: [(&str, &[&str], &str); 6] = [
        ("NCCL_IB_HCA=nosuch", &[], "NCCL_IB_HCA"),
        ("NCCL_IB_GID_INDEX=abc", &["-d", &dev], "NCCL_IB_GID_INDEX"),
        ("IBVERBS_TIMEOUT=99", &[], "IBVERBS_TIMEOUT"),
        ("NCCL_IB_RETRY_CNT=8", &["-d", &dev], "NCCL_IB_RETRY_CNT"),
        ("NCCL_IB_HCA=mlx5_0,,x", &[], "NCCL_IB_HCA"),
        ("NCCL_IB_QPS_PER_CONNECTION=0", &[], "NCCL_IB_QPS_PER_CONNECTION"),
    ];
    let mut port = 18970;
    for tool in ["rc_pingpong", "ud_pingpong", "write_bw", "send_lat"] {
        for (var, flags, name) in &cases {
            port += 1;
            let port_s = port.to_string();
            let mut args = flags.to_vec();
            args.extend(["-p", &port_s, "--accept-timeout", "60"]);
            let f = Running::spawn("env", &with_env(&[var.to_string()], tool, &args)).finish(quick);
            f.assert_failure(quick);
            assert!(
                f.stderr.contains(name),
                "{tool} with {var}: the message does not name {name}: {}",
                f.describe()
            );
            assert!(!f.stderr.contains("panicked"), "{}", f.describe());
        }
    }
}
