//! Host tests of device, port and GID selection (`ibverbs::select`) and of the diagnostics
//! (`ibverbs::diag`): every `NCCL_IB_HCA` syntax case, the GID choice over fake GID tables, the
//! environment variables (ours and NCCL's), and the "no device" and memlock messages. No device
//! is needed: everything works on descriptions written here, or on fake sysfs trees.

#[path = "support/memlock.rs"]
mod memlock;

use std::collections::HashMap;
use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use ibverbs::diag::{FileState, Memlock, SystemReport};
use ibverbs::select::{
    AddrFamily, AddrRange, Config, DeviceDesc, Fabric, GidPolicy, HcaEntry, HcaSelector, Netdev,
    ParseErrorKind, PortDesc, PortProblem, RoceVersion, Selection, VARIABLES,
};
use ibverbs::{ConnectOptions, Error, Gid, GidEntry, GidType, LinkLayer, Mtu, PortState};

// ---------------------------------------------------------------------------------------------
// NCCL_IB_HCA syntax

fn hca(s: &str) -> HcaSelector {
    s.parse().unwrap_or_else(|e| panic!("{s:?} should parse: {e}"))
}

/// Which of the (device, port) pairs `s` selects.
fn selected(s: &str) -> Vec<String> {
    let ports = [("mlx5_0", 1), ("mlx5_0", 2), ("mlx5_1", 1), ("mlx5_10", 1), ("rxe0", 1)];
    let sel = hca(s);
    ports.iter().filter(|(d, p)| sel.matches(d, *p)).map(|(d, p)| format!("{d}:{p}")).collect()
}

#[test]
fn hca_empty_selects_everything() {
    assert!(hca("").is_all());
    assert_eq!(selected(""), ["mlx5_0:1", "mlx5_0:2", "mlx5_1:1", "mlx5_10:1", "rxe0:1"]);
    assert_eq!(HcaSelector::all(), hca(""));
}

#[test]
fn hca_names_match_as_prefixes_by_default() {
    assert_eq!(selected("mlx5"), ["mlx5_0:1", "mlx5_0:2", "mlx5_1:1", "mlx5_10:1"]);
    assert_eq!(selected("mlx5_0"), ["mlx5_0:1", "mlx5_0:2"]);
    // NCCL's pitfall, kept for compatibility: mlx5_1 also matches mlx5_10.
    assert_eq!(selected("mlx5_1"), ["mlx5_1:1", "mlx5_10:1"]);
    assert_eq!(selected("rxe"), ["rxe0:1"]);
    assert_eq!(selected("nothing"), Vec::<String>::new());
}

#[test]
fn hca_ports_restrict_an_entry() {
    assert_eq!(selected("mlx5_0:1"), ["mlx5_0:1"]);
    assert_eq!(selected("mlx5_0:2,rxe0"), ["mlx5_0:2", "rxe0:1"]);
    assert_eq!(selected("mlx5_0:1,mlx5_1"), ["mlx5_0:1", "mlx5_1:1", "mlx5_10:1"]);
    assert_eq!(selected("mlx5_0:3"), Vec::<String>::new());
    assert_eq!(hca("mlx5_0:1,mlx5_1").entries()[0], HcaEntry { name: "mlx5_0".into(), port: Some(1) });
    assert_eq!(hca("mlx5_0:255").entries()[0].port, Some(255));
}

#[test]
fn hca_equals_means_exact_names() {
    let s = hca("=mlx5_1");
    assert!(s.is_exact() && !s.is_exclude());
    assert_eq!(selected("=mlx5_1"), ["mlx5_1:1"]);
    assert_eq!(selected("=mlx5"), Vec::<String>::new());
    assert_eq!(selected("=mlx5_0:2,rxe0"), ["mlx5_0:2", "rxe0:1"]);
}

#[test]
fn hca_caret_excludes() {
    let s = hca("^mlx5_1");
    assert!(s.is_exclude() && !s.is_exact());
    assert_eq!(selected("^mlx5_1"), ["mlx5_0:1", "mlx5_0:2", "rxe0:1"]);
    assert_eq!(selected("^=mlx5_1"), ["mlx5_0:1", "mlx5_0:2", "mlx5_10:1", "rxe0:1"]);
    assert_eq!(selected("^mlx5_0:1"), ["mlx5_0:2", "mlx5_1:1", "mlx5_10:1", "rxe0:1"]);
    assert_eq!(selected("^mlx5,rxe"), Vec::<String>::new());
    assert_eq!(selected("^nothing"), ["mlx5_0:1", "mlx5_0:2", "mlx5_1:1", "mlx5_10:1", "rxe0:1"]);
}

#[test]
fn hca_displays_canonically_and_round_trips() {
    for s in ["", "mlx5_0", "mlx5_0:1,mlx5_1", "=rxe0", "^mlx5_1", "^=mlx5_0:2,mlx5_1:1"] {
        assert_eq!(hca(s).to_string(), s);
        assert_eq!(hca(&hca(s).to_string()), hca(s));
    }
    // Leading zeroes in a port are accepted and dropped.
    assert_eq!(hca("mlx5_0:01").to_string(), "mlx5_0:1");
}

#[test]
fn device_names_compare_naturally() {
    use ibverbs::select::natural_cmp;
    let mut names =
        ["mlx5_10", "rxe1", "mlx5_2", "mlx5_1", "rxe0", "mlx4_0", "mlx5_02", "mlx5", "rxe10", "rxe9"];
    names.sort_by(|a, b| natural_cmp(a, b));
    assert_eq!(
        names,
        ["mlx4_0", "mlx5", "mlx5_1", "mlx5_2", "mlx5_02", "mlx5_10", "rxe0", "rxe1", "rxe9", "rxe10"]
    );
    assert_eq!(natural_cmp("rxe0", "rxe0"), std::cmp::Ordering::Equal);
}

#[test]
fn hca_reports_unmatched_entries() {
    let ports = [("mlx5_0", 1), ("rxe0", 1)];
    let s = hca("mlx5_0,mlx5_7,rxe0:2");
    let unmatched: Vec<String> = s.unmatched(&ports).iter().map(|e| e.to_string()).collect();
    assert_eq!(unmatched, ["mlx5_7", "rxe0:2"]);
    assert!(hca("").unmatched(&ports).is_empty());
}

#[test]
fn hca_bad_syntax_names_the_position() {
    use ParseErrorKind as K;
    let cases: &[(&str, usize, ParseErrorKind)] = &[
        ("^", 1, K::EmptyList),
        ("=", 1, K::EmptyList),
        ("^=", 2, K::EmptyList),
        ("=^mlx5_0", 0, K::ModifierOrder),
        ("mlx5_0,,mlx5_1", 7, K::EmptyEntry),
        (",mlx5_0", 0, K::EmptyEntry),
        ("mlx5_0,", 7, K::EmptyEntry),
        ("^mlx5_0,", 8, K::EmptyEntry),
        (":1", 0, K::EmptyName),
        ("mlx5_0,:1", 7, K::EmptyName),
        ("mlx5_0:", 7, K::BadPort),
        ("mlx5_0:x", 7, K::BadPort),
        ("mlx5_0:1x", 8, K::BadPort),
        ("mlx5_0:-1", 7, K::BadPort),
        ("mlx5_0:0", 7, K::BadPort),
        ("mlx5_0:256", 7, K::BadPort),
        ("mlx5_0:99999999999", 7, K::BadPort),
        ("mlx5_0:1:2", 8, K::UnexpectedChar(':')),
        ("mlx5_0 ", 6, K::UnexpectedChar(' ')),
        ("mlx5_0, mlx5_1", 7, K::UnexpectedChar(' ')),
        ("mlx5\t0", 4, K::UnexpectedChar('\t')),
        ("mlx5_0\n", 6, K::UnexpectedChar('\n')),
        ("mlx5^0", 4, K::UnexpectedChar('^')),
        ("mlx5_0,^mlx5_1", 7, K::UnexpectedChar('^')),
        ("mlx5_0,=mlx5_1", 7, K::UnexpectedChar('=')),
        ("^^mlx5_0", 1, K::UnexpectedChar('^')),
        ("^=^mlx5_0", 2, K::UnexpectedChar('^')),
        ("==mlx5_0", 1, K::UnexpectedChar('=')),
        // Positions are byte offsets: `é` takes two bytes.
        ("é,,x", 3, K::EmptyEntry),
    ];
    for (input, position, kind) in cases {
        let e = input.parse::<HcaSelector>().expect_err(input);
        assert_eq!((e.position, &e.kind), (*position, kind), "{input:?}: {e}");
        assert_eq!(e.input, *input);
        assert!(e.to_string().contains(&format!("at position {position}")), "{e}");
    }
    // Non-ASCII names are names.
    assert!(hca("é0").matches("é0", 1));
}

// ---------------------------------------------------------------------------------------------
// Address families, ranges, RoCE versions

#[test]
fn address_families_parse_nccl_spellings() {
    for s in ["AF_INET", "af_inet", "ipv4", "IPv4", "inet", "4"] {
        assert_eq!(s.parse::<AddrFamily>().unwrap(), AddrFamily::Ipv4, "{s}");
    }
    for s in ["AF_INET6", "ipv6", "inet6", "6"] {
        assert_eq!(s.parse::<AddrFamily>().unwrap(), AddrFamily::Ipv6, "{s}");
    }
    for s in ["AF_UNIX", "", "v4", "AF_INET 6"] {
        let e = s.parse::<AddrFamily>().unwrap_err();
        assert!(matches!(e.kind, ParseErrorKind::Word { .. }), "{s}: {e}");
    }
    assert_eq!(AddrFamily::Ipv6.to_string(), "AF_INET6");
}

#[test]
fn address_ranges_parse_and_contain() {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let r: AddrRange = "10.0.0.0/8".parse().unwrap();
    assert!(r.contains(ip("10.0.0.0")) && r.contains(ip("10.255.255.255")));
    assert!(!r.contains(ip("11.0.0.0")) && !r.contains(ip("::ffff:10.0.0.1")));
    assert_eq!((r.network(), r.prefix_len(), r.family()), (ip("10.0.0.0"), 8, AddrFamily::Ipv4));
    assert_eq!("10.1.2.3/8".parse::<AddrRange>().unwrap(), r);
    let all: AddrRange = "0.0.0.0/0".parse().unwrap();
    assert!(all.contains(ip("192.0.2.1")) && !all.contains(ip("fe80::1")));
    let one: AddrRange = "192.0.2.1/32".parse().unwrap();
    assert!(one.contains(ip("192.0.2.1")) && !one.contains(ip("192.0.2.2")));
    let v6: AddrRange = "fd00::/8".parse().unwrap();
    assert!(v6.contains(ip("fd12::7")) && !v6.contains(ip("fe80::1")) && !v6.contains(ip("10.0.0.1")));
    assert_eq!(v6.to_string(), "fd00::/8");
    assert!("::/0".parse::<AddrRange>().unwrap().contains(ip("fe80::1")));
    assert!("fe80::1/128".parse::<AddrRange>().unwrap().contains(ip("fe80::1")));

    use ParseErrorKind as K;
    let cases: &[(&str, usize, ParseErrorKind)] = &[
        ("10.0.0.0", 8, K::AddrRange),
        ("10.0.0/8", 0, K::AddrRange),
        ("/8", 0, K::AddrRange),
        ("10.0.0.0/", 9, K::AddrRange),
        ("10.0.0.0/x", 9, K::AddrRange),
        ("10.0.0.0/8x", 10, K::AddrRange),
        ("10.0.0.0/-8", 9, K::AddrRange),
        ("10.0.0.0/999", 9, K::PrefixLength { max: 32 }),
        ("10.0.0.0/33", 9, K::PrefixLength { max: 32 }),
        ("fd00::/129", 7, K::PrefixLength { max: 128 }),
        ("10.0.0.0/8/8", 10, K::AddrRange),
    ];
    for (input, position, kind) in cases {
        let e = input.parse::<AddrRange>().expect_err(input);
        assert_eq!((e.position, &e.kind), (*position, kind), "{input:?}: {e}");
    }
    assert!(AddrRange::new(ip("10.0.0.0"), 33).is_err());
}

#[test]
fn roce_versions_are_one_or_two() {
    assert_eq!("1".parse::<RoceVersion>().unwrap(), RoceVersion::V1);
    assert_eq!("2".parse::<RoceVersion>().unwrap(), RoceVersion::V2);
    for s in ["0", "3", "v2", ""] {
        assert!(s.parse::<RoceVersion>().is_err(), "{s}");
    }
    assert_eq!(RoceVersion::V2.gid_type(), GidType::ROCE_V2);
    assert_eq!(RoceVersion::V1.to_string(), "RoCE v1");
}

// ---------------------------------------------------------------------------------------------
// Fake devices

fn gid(ip: &str) -> Gid {
    match ip.parse::<IpAddr>().unwrap() {
        IpAddr::V4(a) => Gid(a.to_ipv6_mapped().octets()),
        IpAddr::V6(a) => Gid(a.octets()),
    }
}

fn entry(index: u32, ip: &str, gid_type: GidType) -> GidEntry {
    GidEntry { gid: gid(ip), index, port: 1, gid_type, ndev_ifindex: 0 }
}

fn eth_port(port: u8, gids: Vec<GidEntry>) -> PortDesc {
    PortDesc {
        port,
        state: PortState::ACTIVE,
        link_layer: LinkLayer::ETHERNET,
        lid: 0,
        active_mtu: Some(Mtu::MTU_4096),
        gid_tbl_len: 16,
        gids,
        netdev: Some(Netdev { name: format!("eth{port}"), oper_state: "up".into(), mtu: Some(9000) }),
    }
}

/// A mlx5-style RoCE table: each address twice, RoCE v1 then RoCE v2 (so NCCL_IB_GID_INDEX=3
/// is the RoCE v2 IPv4 one).
fn mlx5_port() -> PortDesc {
    let (v1, v2) = (GidType::ROCE_V1, GidType::ROCE_V2);
    eth_port(
        1,
        vec![
            entry(0, "fe80::e8eb:d3ff:fe43:25cc", v1),
            entry(1, "fe80::e8eb:d3ff:fe43:25cc", v2),
            entry(2, "10.0.0.7", v1),
            entry(3, "10.0.0.7", v2),
            entry(4, "192.168.1.7", v1),
            entry(5, "192.168.1.7", v2),
            entry(6, "fd00::7", v1),
            entry(7, "fd00::7", v2),
        ],
    )
}

/// A SoftRoCE table: RoCE v2 only, link-local then the IPv4 address.
fn rxe_port(ip: &str) -> PortDesc {
    let mut p = eth_port(1, vec![entry(0, "fe80::1", GidType::ROCE_V2), entry(1, ip, GidType::ROCE_V2)]);
    p.active_mtu = Some(Mtu::MTU_1024);
    p
}

fn ib_port(lid: u16) -> PortDesc {
    PortDesc {
        port: 1,
        state: PortState::ACTIVE,
        link_layer: LinkLayer::INFINIBAND,
        lid,
        active_mtu: Some(Mtu::MTU_4096),
        gid_tbl_len: 128,
        gids: vec![entry(0, "fe80::2", GidType::IB)],
        netdev: None,
    }
}

fn chosen_index(policy: GidPolicy, port: &PortDesc) -> Result<Option<u32>, PortProblem> {
    policy.choose(port).map(|g| g.map(|g| g.index))
}

#[test]
fn automatic_gid_choice_prefers_roce_v2_ipv4_like_nccl() {
    let p = mlx5_port();
    let auto = GidPolicy::default();
    assert_eq!(chosen_index(auto, &p), Ok(Some(3)));
    assert_eq!(chosen_index(GidPolicy { family: Some(AddrFamily::Ipv6), ..auto }, &p), Ok(Some(1)));
    let range = |s: &str| Some(s.parse::<AddrRange>().unwrap());
    assert_eq!(chosen_index(GidPolicy { range: range("192.168.0.0/16"), ..auto }, &p), Ok(Some(5)));
    // The range's family is the family when none is given.
    assert_eq!(chosen_index(GidPolicy { range: range("fd00::/8"), ..auto }, &p), Ok(Some(7)));
    assert_eq!(chosen_index(GidPolicy { roce_version: Some(RoceVersion::V1), ..auto }, &p), Ok(Some(2)));
    let v1_v6 = GidPolicy { roce_version: Some(RoceVersion::V1), family: Some(AddrFamily::Ipv6), ..auto };
    assert_eq!(chosen_index(v1_v6, &p), Ok(Some(0)));
    let none = chosen_index(GidPolicy { range: range("172.16.0.0/12"), ..auto }, &p).unwrap_err();
    let PortProblem::NoMatchingGid { wanted, table } = &none else { panic!("{none:?}") };
    assert!(wanted.contains("AF_INET") && wanted.contains("172.16.0.0/12"), "{wanted}");
    assert!(table.contains("[3] 10.0.0.7 RoCE v2"), "{table}");
    // SoftRoCE: index 1, as the harness and the C tools' `-g 1` use.
    assert_eq!(chosen_index(auto, &rxe_port("192.0.2.1")), Ok(Some(1)));
}

#[test]
fn automatic_gid_choice_falls_back_to_roce_v1_unless_v2_is_required() {
    let p = eth_port(1, vec![entry(0, "fe80::1", GidType::ROCE_V1), entry(1, "10.0.0.1", GidType::ROCE_V1)]);
    assert_eq!(chosen_index(GidPolicy::default(), &p), Ok(Some(1)));
    let strict = GidPolicy { roce_version: Some(RoceVersion::V2), ..GidPolicy::default() };
    assert!(matches!(chosen_index(strict, &p), Err(PortProblem::NoMatchingGid { .. })));
    // An empty table.
    let empty = eth_port(1, Vec::new());
    let e = chosen_index(GidPolicy::default(), &empty).unwrap_err();
    assert!(e.to_string().contains("the table is empty"), "{e}");
}

#[test]
fn an_explicit_gid_index_wins_but_is_checked() {
    let p = mlx5_port();
    let fixed = |index| GidPolicy { index: Some(index), ..GidPolicy::default() };
    assert_eq!(chosen_index(fixed(5), &p), Ok(Some(5)));
    // It wins over family and range...
    let range = Some("10.0.0.0/8".parse().unwrap());
    assert_eq!(
        chosen_index(GidPolicy { range, family: Some(AddrFamily::Ipv6), ..fixed(5) }, &p),
        Ok(Some(5))
    );
    // ... but an empty entry, one beyond the table and one of RoCE v1 are named.
    assert_eq!(chosen_index(fixed(9), &p), Err(PortProblem::GidEmpty { index: 9 }));
    assert_eq!(chosen_index(fixed(16), &p), Err(PortProblem::GidIndexOutOfTable { index: 16, len: 16 }));
    assert_eq!(
        chosen_index(fixed(2), &p),
        Err(PortProblem::GidType { index: 2, found: GidType::ROCE_V1, wanted: RoceVersion::V2 })
    );
    let v1 = GidPolicy { roce_version: Some(RoceVersion::V1), ..fixed(2) };
    assert_eq!(chosen_index(v1, &p), Ok(Some(2)));
    let v1_wrong = GidPolicy { roce_version: Some(RoceVersion::V1), ..fixed(3) };
    assert!(matches!(chosen_index(v1_wrong, &p), Err(PortProblem::GidType { .. })));
    for (policy, words) in [
        (fixed(9), &["GID index 9 is empty"][..]),
        (fixed(2), &["GID index 2 is RoCE v1, not RoCE v2", "IBVERBS_ROCE_VERSION=1"][..]),
        (fixed(16), &["beyond the GID table (16 entries)"][..]),
    ] {
        let e = policy.choose(&p).unwrap_err().to_string();
        for w in words {
            assert!(e.contains(w), "{e:?} lacks {w:?}");
        }
    }
}

#[test]
fn infiniband_ports_use_lid_addressing_unless_an_index_is_given() {
    let p = ib_port(12);
    assert_eq!(chosen_index(GidPolicy::default(), &p), Ok(None));
    // Family and range are RoCE settings: they do not apply.
    let v6 = GidPolicy { family: Some(AddrFamily::Ipv6), ..GidPolicy::default() };
    assert_eq!(chosen_index(v6, &p), Ok(None));
    // An explicit index is used (with a GRH), whatever its type.
    assert_eq!(chosen_index(GidPolicy { index: Some(0), ..GidPolicy::default() }, &p), Ok(Some(0)));
    assert_eq!(
        chosen_index(GidPolicy { index: Some(1), ..GidPolicy::default() }, &p),
        Err(PortProblem::GidEmpty { index: 1 })
    );
}

/// A soft-iWARP port as siw shows it: Ethernet, one GID made from the MAC address, of type IB.
fn siw_port() -> PortDesc {
    let mut p = eth_port(1, vec![entry(0, "7ae7:c908:bc86::", GidType::IB)]);
    p.gid_tbl_len = 1;
    p.netdev = None;
    p
}

#[test]
fn iwarp_ports_take_no_gid_unless_an_index_is_given() {
    let siw = DeviceDesc { iwarp: true, ..DeviceDesc::new("siw0", vec![siw_port()]) };
    // As a RoCE port it would have no usable GID; as iWARP it is chosen, addressed by IP
    // through RDMA-CM, whatever the RoCE settings say.
    let as_roce =
        Selection::default().evaluate(&Fabric { devices: vec![DeviceDesc::new("x", vec![siw_port()])] });
    assert!(matches!(as_roce.rejected[0].problem, PortProblem::NoMatchingGid { .. }), "{as_roce:?}");
    for gid in [
        GidPolicy::default(),
        GidPolicy {
            family: Some(AddrFamily::Ipv6),
            roce_version: Some(RoceVersion::V1),
            ..GidPolicy::default()
        },
    ] {
        let chosen =
            Selection { gid, ..Selection::default() }.select(&Fabric { devices: vec![siw.clone()] }).unwrap();
        assert_eq!((chosen[0].iwarp, chosen[0].gid_index()), (true, None));
        assert_eq!(chosen[0].to_string(), "siw0 port 1, iWARP (RDMA-CM)");
    }
    // An explicit index is checked against the table, not against a RoCE type.
    let index =
        |i| Selection { gid: GidPolicy { index: Some(i), ..GidPolicy::default() }, ..Selection::default() };
    let one = Fabric { devices: vec![siw] };
    let chosen = index(0).select(&one).unwrap();
    assert_eq!(
        (chosen[0].gid_index(), chosen[0].to_string().as_str()),
        (Some(0), "siw0 port 1, GID[0], iWARP (RDMA-CM)")
    );
    let out = index(7).evaluate(&one);
    assert_eq!(out.rejected[0].problem, PortProblem::GidIndexOutOfTable { index: 7, len: 1 });
}

/// mlx5_0 (port 1 RoCE, port 2 RoCE with its netdev down), mlx5_1 (InfiniBand), mlx5_10 (RoCE),
/// rxe0 (SoftRoCE).
fn fabric() -> Fabric {
    let mut down = mlx5_port();
    down.port = 2;
    down.state = PortState::DOWN;
    down.netdev = Some(Netdev { name: "eth2".into(), oper_state: "down".into(), mtu: Some(9000) });
    Fabric {
        devices: vec![
            DeviceDesc::new("mlx5_0", vec![mlx5_port(), down]),
            DeviceDesc::new("mlx5_1", vec![ib_port(12)]),
            DeviceDesc::new("mlx5_10", vec![mlx5_port()]),
            DeviceDesc::new("rxe0", vec![rxe_port("192.0.2.1")]),
        ],
    }
}

fn names(choices: &[ibverbs::select::Choice]) -> Vec<String> {
    choices.iter().map(|c| format!("{}:{}", c.device, c.port)).collect()
}

fn selection(hca_text: &str) -> Selection {
    Selection { hca: hca(hca_text), ..Selection::default() }
}

#[test]
fn selection_keeps_active_ports_in_natural_name_order() {
    let out = Selection::default().evaluate(&fabric());
    assert_eq!(names(&out.chosen), ["mlx5_0:1", "mlx5_1:1", "mlx5_10:1", "rxe0:1"]);
    assert_eq!(out.rejected.len(), 1);
    let r = &out.rejected[0];
    assert_eq!((r.device.as_str(), r.port), ("mlx5_0", Some(2)));
    assert!(matches!(r.problem, PortProblem::NotActive { state: PortState::DOWN, .. }));
    let text = r.to_string();
    assert!(text.contains("port state DOWN is not ACTIVE"), "{text}");
    assert!(text.contains("eth2 is down") && text.contains("ip link set eth2 up"), "{text}");
    // Whatever order the kernel lists the devices in, they are used in natural name order.
    let mut shuffled = fabric();
    shuffled.devices.reverse();
    shuffled.devices.push(DeviceDesc::new("mlx5_2", vec![mlx5_port()]));
    assert_eq!(
        names(&Selection::default().select(&shuffled).unwrap()),
        ["mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx5_10:1", "rxe0:1"]
    );
    // The order of the names does not reorder the ports.
    assert_eq!(names(&selection("rxe0,mlx5_0").select(&fabric()).unwrap()), ["mlx5_0:1", "rxe0:1"]);
    // What each choice carries.
    let c = &selection("=mlx5_0").select(&fabric()).unwrap()[0];
    assert_eq!(
        (c.gid_index(), c.link_layer, c.active_mtu),
        (Some(3), LinkLayer::ETHERNET, Some(Mtu::MTU_4096))
    );
    assert_eq!(c.to_string(), "mlx5_0 port 1, GID[3] 10.0.0.7 (RoCE v2)");
    let ib = &selection("=mlx5_1").select(&fabric()).unwrap()[0];
    assert_eq!((ib.gid, ib.lid), (None, 12));
    assert_eq!(ib.to_string(), "mlx5_1 port 1, LID 12");
}

#[test]
fn selection_applies_the_hca_list_and_says_why_ports_are_left_out() {
    let f = fabric();
    assert_eq!(names(&selection("mlx5_1").select(&f).unwrap()), ["mlx5_1:1", "mlx5_10:1"]);
    assert_eq!(names(&selection("=mlx5_1").select(&f).unwrap()), ["mlx5_1:1"]);
    assert_eq!(names(&selection("^mlx5").select(&f).unwrap()), ["rxe0:1"]);
    assert_eq!(names(&selection("^=mlx5_0,mlx5_1").select(&f).unwrap()), ["mlx5_10:1", "rxe0:1"]);
    let out = selection("^=rxe0").evaluate(&f);
    let rxe = out.rejected.iter().find(|r| r.device == "rxe0").unwrap();
    assert_eq!(rxe.problem, PortProblem::Excluded { entry: "rxe0".into() });
    assert_eq!(rxe.to_string(), "rxe0 port 1: excluded (by ^rxe0)");
    let out = selection("rxe0,mlx5_7").evaluate(&f);
    assert_eq!(out.unmatched, [HcaEntry { name: "mlx5_7".into(), port: None }]);
    assert!(out.rejected.iter().any(|r| r.device == "mlx5_0" && r.problem == PortProblem::NotListed));

    // Only a port that is down: a typed error listing every port and its problem.
    let e = selection("mlx5_0:2").select(&f).unwrap_err();
    let Error::NoUsablePort { selection, rejected } = &e else { panic!("{e:?}") };
    assert!(selection.contains("devices mlx5_0:2"), "{selection}");
    assert_eq!(rejected.len(), 5);
    let msg = e.to_string();
    assert!(msg.contains("mlx5_0 port 2: port state DOWN is not ACTIVE"), "{msg}");
    assert!(msg.contains("rxe0 port 1: not selected"), "{msg}");
}

#[test]
fn selection_checks_the_mtu_asked_for() {
    let s = Selection { mtu: Some(Mtu::MTU_2048), ..Selection::default() };
    let out = s.evaluate(&fabric());
    assert!(!names(&out.chosen).contains(&"rxe0:1".to_string()));
    let rxe = out.rejected.iter().find(|r| r.device == "rxe0").unwrap();
    assert_eq!(rxe.problem, PortProblem::MtuAboveActive { requested: Mtu::MTU_2048, active: Mtu::MTU_1024 });
    assert!(rxe.to_string().contains("MTU 2048 asked for is above the port's active MTU 1024"), "{rxe}");
    // An unknown active MTU (a description from sysfs) is not held against the port.
    let mut f = fabric();
    f.devices[3].ports[0].active_mtu = None;
    assert!(names(&s.select(&f).unwrap()).contains(&"rxe0:1".to_string()));
}

#[test]
fn selection_reports_devices_that_cannot_be_used_and_odd_link_layers() {
    let mut f = fabric();
    f.devices[0].error = Some("ibv_open_device failed: Permission denied".into());
    f.devices[2].ports[0].link_layer = LinkLayer(7);
    let out = Selection::default().evaluate(&f);
    assert_eq!(names(&out.chosen), ["mlx5_1:1", "rxe0:1"]);
    assert!(out.rejected.iter().any(|r| r.device == "mlx5_0"
        && r.port.is_none()
        && matches!(r.problem, PortProblem::DeviceUnavailable { .. })));
    assert!(out
        .rejected
        .iter()
        .any(|r| r.problem == PortProblem::UnsupportedLinkLayer { link_layer: LinkLayer(7) }));
}

#[test]
fn not_active_messages_point_to_the_cause() {
    let mut p = ib_port(0);
    p.state = PortState::INIT;
    let d = DeviceDesc::new("mlx5_1", vec![p.clone()]);
    let e = Selection::default().check_port(&d, &p).unwrap_err().to_string();
    assert!(e.contains("INIT is not ACTIVE") && e.contains("subnet manager"), "{e}");
    p.state = PortState::DOWN;
    let e = Selection::default().check_port(&d, &p).unwrap_err().to_string();
    assert!(e.contains("DOWN is not ACTIVE") && e.contains("cable"), "{e}");
}

#[test]
fn resolving_an_explicit_port_names_its_problem() {
    let f = fabric();
    let s = Selection::default();
    let c = s.resolve(&f, "mlx5_10", 1).unwrap();
    assert_eq!((c.device.as_str(), c.gid_index()), ("mlx5_10", Some(3)));
    // The device list does not apply to an explicit port.
    assert!(selection("^mlx5").resolve(&f, "mlx5_10", 1).is_ok());
    let e = s.resolve(&f, "mlx5_0", 2).unwrap_err();
    assert!(
        matches!(&e, Error::Port { device, port: 2, problem: PortProblem::NotActive { .. } } if device == "mlx5_0"),
        "{e:?}"
    );
    assert!(e.to_string().starts_with("mlx5_0 port 2: port state DOWN is not ACTIVE"), "{e}");
    let e = s.resolve(&f, "mlx5_0", 3).unwrap_err();
    assert!(matches!(e, Error::Port { problem: PortProblem::NoSuchPort { ports: 2 }, .. }), "{e:?}");
    let e = s.resolve(&f, "mlx5_9", 1).unwrap_err();
    assert!(
        matches!(&e, Error::DeviceNotFound { name, available } if name == "mlx5_9" && available.contains("rxe0"))
    );
    let gid = Selection { gid: GidPolicy { index: Some(2), ..GidPolicy::default() }, ..Selection::default() };
    let e = gid.resolve(&f, "mlx5_0", 1).unwrap_err();
    assert!(e.to_string().contains("GID index 2 is RoCE v1, not RoCE v2"), "{e}");
    let e =
        Selection { mtu: Some(Mtu::MTU_4096), ..Selection::default() }.resolve(&f, "rxe0", 1).unwrap_err();
    assert!(matches!(e, Error::Port { problem: PortProblem::MtuAboveActive { .. }, .. }), "{e:?}");
}

#[test]
fn no_device_at_all_says_what_the_host_lacks() {
    let e = Selection::default().select(&Fabric::default()).unwrap_err();
    let Error::DeviceNotFound { name, available } = &e else { panic!("{e:?}") };
    assert_eq!((name.as_str(), available.as_str()), ("<any>", "none"));
    // Read from this host: whichever applies, the message names the place to look.
    let msg = e.to_string();
    assert!(msg.contains("/sys/class/infiniband") || msg.contains("/dev/infiniband"), "{msg}");
    let e = selection("mlx5_0").select(&Fabric::default()).unwrap_err();
    assert!(matches!(&e, Error::DeviceNotFound { name, .. } if name == "mlx5_0"), "{e:?}");
    // A device list with devices adds nothing.
    let e = Selection::default().resolve(&fabric(), "nope", 1).unwrap_err().to_string();
    assert!(!e.contains("/dev/infiniband"), "{e}");
}

#[test]
fn a_choice_gives_its_port_and_gid_to_connect_options() {
    let c = &selection("=rxe0").select(&fabric()).unwrap()[0];
    let base = ConnectOptions { timeout: 20, retry_cnt: 5, ..ConnectOptions::default() };
    let o = c.connect_options(&base);
    assert_eq!((o.port, o.gid_index, o.timeout, o.retry_cnt), (1, Some(1), 20, 5));
}

// ---------------------------------------------------------------------------------------------
// Environment variables

fn config(vars: &[(&str, &str)]) -> ibverbs::Result<Config> {
    let env: HashMap<&str, &str> = vars.iter().copied().collect();
    Config::from_vars(|name| env.get(name).copied())
}

#[test]
fn no_variables_mean_the_defaults() {
    let c = config(&[]).unwrap();
    assert_eq!(c.selection, Selection::default());
    assert_eq!(c.connect, ConnectOptions::default());
    assert!(c.settings.is_empty());
    assert_eq!(c.describe(), "no IBVERBS_*/NCCL_IB_* variable set");
}

#[test]
fn an_nccl_job_runs_unchanged() {
    // The settings of the primer's NCCL job.
    let c = config(&[
        ("NCCL_IB_HCA", "mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7,mlx5_8"),
        ("NCCL_IB_GID_INDEX", "3"),
        ("NCCL_IB_QPS_PER_CONNECTION", "8"),
        ("NCCL_IB_TIMEOUT", "23"),
        ("NCCL_IB_RETRY_CNT", "7"),
        ("NCCL_SOCKET_IFNAME", "eth0"),
    ])
    .unwrap();
    assert_eq!(c.selection.hca.entries().len(), 8);
    assert_eq!((c.selection.gid.index, c.connect.gid_index), (Some(3), Some(3)));
    assert_eq!((c.connect.timeout, c.connect.retry_cnt), (23, 7));
    let used: Vec<&str> = c.settings.iter().map(|s| s.variable).collect();
    assert_eq!(
        used,
        [
            "NCCL_IB_HCA",
            "NCCL_IB_GID_INDEX",
            "NCCL_IB_TIMEOUT",
            "NCCL_IB_RETRY_CNT",
            "NCCL_IB_QPS_PER_CONNECTION"
        ]
    );
    assert_eq!((c.stripe.qps, c.stripe.split_data), (8, true));
    // Over the fake fabric: mlx5_1 (and, by prefix, mlx5_10); GID index 3 is empty on InfiniBand
    // mlx5_1, which is named.
    let out = c.selection.evaluate(&fabric());
    assert_eq!(names(&out.chosen), ["mlx5_10:1"]);
    assert!(out
        .rejected
        .iter()
        .any(|r| r.device == "mlx5_1" && r.problem == PortProblem::GidEmpty { index: 3 }));
    assert_eq!(out.unmatched.len(), 7);
}

#[test]
fn every_variable_is_read_with_ours_winning() {
    let c = config(&[
        ("NCCL_IB_HCA", "mlx5"),
        ("IBVERBS_HCA", "=rxe0:1"),
        ("NCCL_IB_GID_INDEX", "-1"),
        ("NCCL_IB_ADDR_FAMILY", "AF_INET6"),
        ("IBVERBS_ADDR_RANGE", "fd00::/8"),
        ("NCCL_IB_ROCE_VERSION_NUM", "2"),
        ("IBVERBS_TIMEOUT", "18"),
        ("NCCL_IB_TIMEOUT", "22"),
        ("NCCL_IB_RETRY_CNT", "4"),
        ("NCCL_IB_SL", "3"),
        ("NCCL_IB_TC", "106"),
        ("NCCL_IB_PKEY", "2"),
        ("IBVERBS_MTU", "2048"),
        ("NCCL_IB_QPS_PER_CONNECTION", "2"),
        ("IBVERBS_QPS_PER_CONNECTION", "4"),
        ("NCCL_IB_SPLIT_DATA_ON_QPS", "0"),
    ])
    .unwrap();
    assert_eq!((c.stripe.qps, c.stripe.split_data), (4, false));
    assert_eq!(c.selection.hca.to_string(), "=rxe0:1");
    assert_eq!(c.selection.gid.index, None);
    assert_eq!(c.selection.gid.family, Some(AddrFamily::Ipv6));
    assert_eq!(c.selection.gid.range, Some("fd00::/8".parse().unwrap()));
    assert_eq!(c.selection.gid.roce_version, Some(RoceVersion::V2));
    assert_eq!(c.selection.mtu, Some(Mtu::MTU_2048));
    let o = &c.connect;
    assert_eq!((o.timeout, o.retry_cnt, o.sl, o.traffic_class, o.pkey_index), (18, 4, 3, 106, 2));
    assert_eq!((o.mtu, o.gid_index), (Some(Mtu::MTU_2048), None));
    assert!(c.describe().contains("IBVERBS_HCA=\"=rxe0:1\"") && c.describe().contains("NCCL_IB_TC=\"106\""));
    assert!(!c.describe().contains("NCCL_IB_HCA"), "{}", c.describe());
    // Every variable is in the table, with its NCCL name where NCCL has one.
    for (ours, nccl) in [("IBVERBS_HCA", "NCCL_IB_HCA"), ("IBVERBS_PKEY_INDEX", "NCCL_IB_PKEY")] {
        assert!(VARIABLES.iter().any(|v| v.name == ours && v.nccl == Some(nccl)));
    }
    assert_eq!(VARIABLES.len(), 13);
}

#[test]
fn an_empty_value_means_the_default_and_hides_nccls() {
    let c = config(&[("IBVERBS_HCA", ""), ("NCCL_IB_HCA", "mlx5_0"), ("IBVERBS_GID_INDEX", "")]).unwrap();
    assert!(c.selection.hca.is_all());
    assert_eq!(c.selection.gid.index, None);
    assert_eq!(c.settings.len(), 2);
}

#[test]
fn invalid_values_are_errors_naming_the_variable() {
    let cases: &[(&str, &str, usize)] = &[
        ("NCCL_IB_HCA", "mlx5_0,,mlx5_1", 7),
        ("IBVERBS_HCA", "mlx5_0:x", 7),
        ("NCCL_IB_GID_INDEX", "256", 0),
        ("NCCL_IB_GID_INDEX", "-2", 0),
        ("IBVERBS_GID_INDEX", "3a", 1),
        ("NCCL_IB_ADDR_FAMILY", "AF_UNIX", 0),
        ("NCCL_IB_ADDR_RANGE", "10.0.0.0/33", 9),
        ("NCCL_IB_ROCE_VERSION_NUM", "3", 0),
        ("NCCL_IB_TIMEOUT", "32", 0),
        ("IBVERBS_TIMEOUT", "fast", 0),
        ("NCCL_IB_RETRY_CNT", "8", 0),
        ("NCCL_IB_SL", "16", 0),
        ("NCCL_IB_TC", "256", 0),
        ("NCCL_IB_PKEY", "65536", 0),
        ("NCCL_IB_QPS_PER_CONNECTION", "0", 0),
        ("IBVERBS_QPS_PER_CONNECTION", "65", 0),
        ("NCCL_IB_SPLIT_DATA_ON_QPS", "2", 0),
        ("IBVERBS_MTU", "1500", 0),
        ("IBVERBS_MTU", "4k", 0),
    ];
    for &(variable, value, position) in cases {
        let e = config(&[(variable, value)]).unwrap_err();
        let Error::Setting { variable: Some(v), error } = &e else { panic!("{variable}={value}: {e:?}") };
        assert_eq!((*v, error.input.as_str(), error.position), (variable, value, position), "{e}");
        assert!(e.to_string().starts_with(&format!("{variable}={value:?}: ")), "{e}");
    }
    // Ours is checked even when NCCL's is fine, and NCCL's even when ours... is unset only.
    let e = config(&[("IBVERBS_TIMEOUT", "99"), ("NCCL_IB_TIMEOUT", "20")]).unwrap_err();
    assert!(matches!(e, Error::Setting { variable: Some("IBVERBS_TIMEOUT"), .. }), "{e:?}");
    assert!(config(&[("IBVERBS_TIMEOUT", "20"), ("NCCL_IB_TIMEOUT", "99")]).is_ok());
}

#[test]
fn a_range_of_the_other_family_is_a_conflict() {
    let e = config(&[("NCCL_IB_ADDR_FAMILY", "AF_INET6"), ("NCCL_IB_ADDR_RANGE", "10.0.0.0/8")]).unwrap_err();
    let Error::Setting { variable: Some("NCCL_IB_ADDR_RANGE"), error } = &e else { panic!("{e:?}") };
    assert_eq!(error.kind, ParseErrorKind::Conflict { with: "NCCL_IB_ADDR_FAMILY=AF_INET6".into() });
    assert!(config(&[("NCCL_IB_ADDR_FAMILY", "AF_INET"), ("NCCL_IB_ADDR_RANGE", "10.0.0.0/8")]).is_ok());
}

#[test]
fn a_value_that_is_not_utf8_is_an_error() {
    use std::ffi::OsString;
    use std::os::unix::ffi::OsStringExt;
    let e = Config::from_vars(|name| {
        (name == "NCCL_IB_HCA").then(|| OsString::from_vec(vec![b'm', b'l', b'x', 0xff, b'0']))
    })
    .unwrap_err();
    let Error::Setting { variable: Some("NCCL_IB_HCA"), error } = &e else { panic!("{e:?}") };
    assert_eq!((error.position, &error.kind), (3, &ParseErrorKind::NotUnicode));
}

#[test]
fn selection_errors_name_the_variables() {
    let c = config(&[("NCCL_IB_HCA", "=mlx5_0:2")]).unwrap();
    let e = c.select_in(&fabric()).unwrap_err().to_string();
    assert!(e.starts_with("no usable RDMA port for NCCL_IB_HCA=\"=mlx5_0:2\""), "{e}");
    let c = config(&[("IBVERBS_HCA", "rxe"), ("IBVERBS_TIMEOUT", "19")]).unwrap();
    let choices = c.select_in(&fabric()).unwrap();
    let o = c.connect_options(&choices[0]);
    assert_eq!((o.port, o.gid_index, o.timeout), (1, Some(1), 19));
}

// ---------------------------------------------------------------------------------------------
// Fake sysfs trees: the description from sysfs, and the host checks

/// A fresh empty directory under the system's temporary directory.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ibverbs-select-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn put(root: &Path, path: &str, text: &str) {
    let p = root.join(path);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, text).unwrap();
}

/// rxe0 over dummy0 (ACTIVE, GIDs fe80::1 and 192.0.2.1) and mlx5_0 (InfiniBand, port 1 ACTIVE,
/// port 2 DOWN), as sysfs shows them.
fn fake_sysfs(root: &Path) {
    let rxe = "sys/class/infiniband/rxe0";
    put(root, &format!("{rxe}/node_guid"), "505a:a4ff:fe3c:11d2\n");
    let p = format!("{rxe}/ports/1");
    put(root, &format!("{p}/state"), "4: ACTIVE\n");
    put(root, &format!("{p}/link_layer"), "Ethernet\n");
    put(root, &format!("{p}/lid"), "0x0\n");
    put(root, &format!("{p}/gids/0"), "fe80:0000:0000:0000:0000:0000:0000:0001\n");
    put(root, &format!("{p}/gids/1"), "0000:0000:0000:0000:0000:ffff:c000:0201\n");
    put(root, &format!("{p}/gids/2"), "0000:0000:0000:0000:0000:0000:0000:0000\n");
    put(root, &format!("{p}/gids/3"), "0000:0000:0000:0000:0000:0000:0000:0000\n");
    for i in 0..2 {
        put(root, &format!("{p}/gid_attrs/types/{i}"), "RoCE v2\n");
        put(root, &format!("{p}/gid_attrs/ndevs/{i}"), "dummy0\n");
    }
    put(root, &format!("{rxe}/node_type"), "1: CA\n");
    put(root, "sys/class/net/dummy0/operstate", "unknown\n");
    put(root, "sys/class/net/dummy0/mtu", "1500\n");
    put(root, "sys/class/net/dummy0/ifindex", "2\n");
    let mlx = "sys/class/infiniband/mlx5_0";
    put(root, &format!("{mlx}/node_guid"), "e8eb:d303:0043:25cc\n");
    for (port, state) in [(1, "4: ACTIVE"), (2, "1: DOWN")] {
        let p = format!("{mlx}/ports/{port}");
        put(root, &format!("{p}/state"), &format!("{state}\n"));
        put(root, &format!("{p}/link_layer"), "InfiniBand\n");
        put(root, &format!("{p}/lid"), "0xc\n");
        put(root, &format!("{p}/gids/0"), "fe80:0000:0000:0000:e8eb:d303:0043:25cc\n");
        put(root, &format!("{p}/gids/1"), "0000:0000:0000:0000:0000:0000:0000:0000\n");
        put(root, &format!("{p}/gid_attrs/types/0"), "IB/RoCE v1\n");
    }
}

#[test]
fn a_fabric_reads_from_a_sysfs_tree() {
    let root = scratch("sysfs");
    fake_sysfs(&root);
    let f = Fabric::from_sysfs(&root).unwrap();
    assert_eq!(f.names(), "mlx5_0, rxe0"); // name order
    let rxe = f.device("rxe0").unwrap();
    assert_eq!(rxe.node_guid.to_string(), "505a:a4ff:fe3c:11d2");
    let p = &rxe.ports[0];
    assert_eq!(
        (p.port, p.state, p.link_layer, p.lid, p.active_mtu),
        (1, PortState::ACTIVE, LinkLayer::ETHERNET, 0, None)
    );
    assert_eq!(p.gid_tbl_len, 4);
    assert_eq!(p.gids.len(), 2);
    assert_eq!((p.gids[1].index, p.gids[1].gid_type, p.gids[1].ndev_ifindex), (1, GidType::ROCE_V2, 2));
    assert_eq!(p.gids[1].gid.ip().to_string(), "192.0.2.1");
    assert_eq!(
        p.netdev,
        Some(Netdev { name: "dummy0".into(), oper_state: "unknown".into(), mtu: Some(1500) })
    );
    let mlx = f.device("mlx5_0").unwrap();
    assert_eq!(mlx.ports.len(), 2);
    assert_eq!((mlx.ports[0].lid, mlx.ports[0].gids[0].gid_type), (12, GidType::IB));
    assert_eq!(mlx.ports[1].state, PortState::DOWN);
    assert_eq!(mlx.ports[0].netdev, None);
    // And the selection over it.
    let out = Selection::default().evaluate(&f);
    assert_eq!(names(&out.chosen), ["mlx5_0:1", "rxe0:1"]);
    assert_eq!(out.chosen[1].gid_index(), Some(1));
    assert!(!rxe.iwarp && !mlx.iwarp);
    // siw0: node type RNIC, one GID without a RoCE type.
    let siw = "sys/class/infiniband/siw0";
    put(&root, &format!("{siw}/node_type"), "4: RNIC\n");
    put(&root, &format!("{siw}/ports/1/state"), "4: ACTIVE\n");
    put(&root, &format!("{siw}/ports/1/link_layer"), "Ethernet\n");
    put(&root, &format!("{siw}/ports/1/gids/0"), "7ae7:c908:bc86:0000:0000:0000:0000:0000\n");
    put(&root, "sys/class/net/eth9/address", "7a:e7:c9:08:bc:86\n");
    put(&root, "sys/class/net/eth9/operstate", "up\n");
    let f = Fabric::from_sysfs(&root).unwrap();
    let siw = f.device("siw0").unwrap();
    assert!(siw.iwarp);
    // Its GID has no type in sysfs (IB, as the verbs say); its netdev is the one of its MAC.
    assert_eq!(siw.ports[0].gids[0].gid_type, GidType::IB);
    assert_eq!(
        siw.ports[0].netdev.as_ref().map(|n| (n.name.as_str(), n.oper_state.as_str())),
        Some(("eth9", "up"))
    );
    let chosen = Selection { hca: hca("siw"), ..Selection::default() }.select(&f).unwrap();
    assert_eq!((chosen[0].device.as_str(), chosen[0].iwarp, chosen[0].gid_index()), ("siw0", true, None));
    // A device whose files are broken is described with its error.
    fs::remove_dir_all(root.join("sys/class/infiniband/mlx5_0/ports/1/gids")).unwrap();
    let f = Fabric::from_sysfs(&root).unwrap();
    assert!(f.device("mlx5_0").unwrap().error.is_some());
    // No RDMA at all: an empty fabric.
    assert_eq!(Fabric::from_sysfs(&root.join("nothing")).unwrap(), Fabric::default());
    let _ = fs::remove_dir_all(&root);
}

#[test]
fn host_checks_name_what_is_missing_and_the_fix() {
    let root = scratch("host");
    // Nothing at all: no RDMA core.
    let r = SystemReport::gather_at(&root);
    assert_eq!((r.kernel_devices.as_ref(), r.dev_infiniband.as_ref(), r.uverbs_loaded), (None, None, false));
    let hint = r.no_device_hint();
    assert!(hint.contains("/sys/class/infiniband does not exist") && hint.contains("modprobe"), "{hint}");

    // The core, but no device.
    fs::create_dir_all(root.join("sys/class/infiniband")).unwrap();
    fs::create_dir_all(root.join("sys/module/ib_core")).unwrap();
    let hint = SystemReport::gather_at(&root).no_device_hint();
    assert!(
        hint.contains("/sys/class/infiniband is empty") && hint.contains("modules loaded: ib_core"),
        "{hint}"
    );

    // A device, but no ib_uverbs.
    fs::create_dir_all(root.join("sys/class/infiniband/mlx5_0")).unwrap();
    fs::create_dir_all(root.join("sys/module/mlx5_ib")).unwrap();
    let r = SystemReport::gather_at(&root);
    assert_eq!(r.modules, ["ib_core", "mlx5_ib"]);
    let hint = r.no_device_hint();
    assert!(hint.contains("ib_uverbs") && hint.contains("`modprobe ib_uverbs`"), "{hint}");

    // ib_uverbs, but no /dev/infiniband: a container the files were not passed to.
    put(&root, "sys/class/infiniband_verbs/uverbs0/ibdev", "mlx5_0\n");
    let r = SystemReport::gather_at(&root);
    assert_eq!(r.uverbs[0].name, "uverbs0");
    assert_eq!((r.uverbs[0].ibdev.as_str(), r.uverbs[0].file), ("mlx5_0", FileState::Missing));
    let hint = r.no_device_hint();
    assert!(
        hint.contains("/dev/infiniband does not exist") && hint.contains("--device=/dev/infiniband"),
        "{hint}"
    );

    // /dev/infiniband, but not this device's file.
    put(&root, "dev/infiniband/rdma_cm", "");
    let hint = SystemReport::gather_at(&root).no_device_hint();
    assert!(hint.contains("/dev/infiniband/uverbs0 (the device file of mlx5_0) is missing"), "{hint}");

    // Everything in place: the provider library is what remains.
    put(&root, "dev/infiniband/uverbs0", "");
    let r = SystemReport::gather_at(&root);
    assert_eq!(r.dev_infiniband.as_deref(), Some(&["rdma_cm".to_string(), "uverbs0".to_string()][..]));
    assert!(r.problems().iter().all(|p| p.contains("RLIMIT_MEMLOCK")), "{:?}", r.problems());
    assert!(r.no_device_hint().contains("ibverbs-providers"), "{}", r.no_device_hint());
    let _ = fs::remove_dir_all(&root);
}

#[test]
fn a_registration_refused_for_memlock_names_rlimit_memlock_and_the_fix() {
    let enomem = |verb| Error::Verb { verb, source: std::io::Error::from_raw_os_error(libc::ENOMEM) };
    // Whatever this process's limit: the message names RLIMIT_MEMLOCK.
    let msg = enomem("ibv_reg_mr").to_string();
    assert!(msg.starts_with("ibv_reg_mr failed: ") && msg.contains("RLIMIT_MEMLOCK"), "{msg}");
    // Other verbs and errors add nothing.
    assert!(!enomem("ibv_alloc_pd").to_string().contains("RLIMIT_MEMLOCK"));
    let einval = Error::Verb { verb: "ibv_reg_mr", source: std::io::Error::from_raw_os_error(libc::EINVAL) };
    assert!(!einval.to_string().contains("RLIMIT_MEMLOCK"));

    // With a 64 KiB limit and without CAP_IPC_LOCK, as an unprivileged job would run.
    let (memlock, msg, eperm, cq, problems) = memlock::with_memlock(64 << 10, || {
        let eperm =
            Error::Verb { verb: "ibv_reg_mr", source: std::io::Error::from_raw_os_error(libc::EPERM) };
        (
            Memlock::current().unwrap(),
            enomem("ibv_reg_mr").to_string(),
            eperm.to_string(),
            enomem("ibv_create_cq").to_string(),
            SystemReport::gather().problems(),
        )
    });

    assert_eq!(memlock.soft, Some(65536));
    assert!(!memlock.cap_ipc_lock && memlock.limits_registration());
    for m in [&msg, &eperm] {
        assert!(m.contains("RLIMIT_MEMLOCK is 64 KiB"), "{m}");
        assert!(m.contains("ulimit -l unlimited") && m.contains("--ulimit memlock=-1"), "{m}");
    }
    assert!(cq.contains("queue buffers") && cq.contains("RLIMIT_MEMLOCK is 64 KiB"), "{cq}");
    assert!(problems.iter().any(|p| p.contains("RLIMIT_MEMLOCK is 64 KiB")), "{problems:?}");
}
