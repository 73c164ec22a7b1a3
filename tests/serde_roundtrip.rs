//! serde (feature `serde`) on the host: every wire and configuration type goes to JSON and back
//! unchanged, reads what a hand-written configuration file holds, refuses bad values by name, and
//! the crate's compact encodings are untouched.

use std::collections::HashMap;

use ibverbs::select::{AddrFamily, AddrRange, Config, GidPolicy, HcaSelector, RoceVersion, Selection};
use ibverbs::striped::{EndpointList, StripeOptions};
use ibverbs::{AccessFlags, ConnectOptions, Endpoint, Gid, Mtu, RemoteSlice};
use serde::{de::DeserializeOwned, Serialize};

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(value: &T) -> String {
    let text = serde_json::to_string(value).unwrap();
    let back: T = serde_json::from_str(&text).unwrap();
    assert_eq!(&back, value, "through {text}");
    text
}

fn endpoint() -> Endpoint {
    let mut gid = [0u8; 16];
    gid[10] = 0xff;
    gid[11] = 0xff;
    gid[12..].copy_from_slice(&[192, 0, 2, 1]);
    Endpoint { qpn: 0x12_3456, psn: 0xab_cdef, lid: 7, gid: Gid(gid), mtu: Mtu::MTU_1024 }
}

#[test]
fn endpoints_and_remote_slices_round_trip_and_keep_their_compact_encodings() {
    let ep = endpoint();
    let text = round_trip(&ep);
    assert_eq!(text, r#"{"qpn":1193046,"psn":11259375,"lid":7,"gid":"::ffff:192.0.2.1","mtu":1024}"#);
    assert_eq!(Endpoint::decode(&ep.encode()).unwrap(), ep, "the compact encoding is unchanged");
    // ibv_devinfo's GID form is read too.
    let devinfo = text.replace("::ffff:192.0.2.1", "0000:0000:0000:0000:0000:ffff:c000:0201");
    assert_eq!(serde_json::from_str::<Endpoint>(&devinfo).unwrap(), ep);
    let slice = RemoteSlice { addr: 0x7f00_1234_5000, len: 4096, rkey: 0xdead_beef };
    assert_eq!(
        round_trip(&slice),
        format!(r#"{{"addr":{},"len":4096,"rkey":3735928559}}"#, 0x7f00_1234_5000u64)
    );
    assert_eq!(RemoteSlice::decode(&slice.encode()).unwrap(), slice);
    let list = EndpointList(vec![ep, Endpoint { qpn: 9, ..ep }]);
    round_trip(&list);
    assert_eq!(EndpointList::decode(&list.encode()).unwrap(), list);
}

#[test]
fn connect_options_and_the_select_configuration_round_trip() {
    let mut o =
        ConnectOptions { timeout: 18, mtu: Some(Mtu::MTU_2048), psn: Some(5), ..ConnectOptions::default() };
    o.access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
    let text = round_trip(&o);
    assert!(text.contains(r#""access":"LOCAL_WRITE | REMOTE_READ""#), "{text}");
    round_trip(&ConnectOptions::default());
    let selection = Selection {
        hca: "^=mlx5_1:1,mlx5_2".parse::<HcaSelector>().unwrap(),
        gid: GidPolicy {
            index: Some(3),
            family: Some(AddrFamily::Ipv6),
            range: Some("fd00::/8".parse::<AddrRange>().unwrap()),
            roce_version: Some(RoceVersion::V2),
        },
        mtu: Some(Mtu::MTU_4096),
    };
    let text = round_trip(&selection);
    assert!(
        text.contains(r#""hca":"^=mlx5_1:1,mlx5_2""#) && text.contains(r#""range":"fd00::/8""#),
        "{text}"
    );
    round_trip(&Selection::default());
    round_trip(&StripeOptions { qps: 4, split_data: false, ..StripeOptions::default() });
    // A configuration read from the environment, then kept in a file: the settings read are
    // not configuration and are not serialized.
    let env: HashMap<&str, &str> =
        [("NCCL_IB_HCA", "=mlx5_0:1"), ("NCCL_IB_TIMEOUT", "20"), ("NCCL_IB_QPS_PER_CONNECTION", "2")].into();
    let config = Config::from_vars(|name| env.get(name).copied()).unwrap();
    assert_eq!(config.settings.len(), 3);
    let text = serde_json::to_string(&config).unwrap();
    let back: Config = serde_json::from_str(&text).unwrap();
    assert!(back.settings.is_empty());
    assert_eq!(Config { settings: Vec::new(), ..config }, back);
}

#[test]
fn a_configuration_file_names_only_what_it_changes() {
    let o: ConnectOptions = serde_json::from_str(r#"{"timeout": 20, "retry_cnt": 5}"#).unwrap();
    assert_eq!(o, ConnectOptions { timeout: 20, retry_cnt: 5, ..ConnectOptions::default() });
    let c: Config =
        serde_json::from_str(r#"{"selection": {"hca": "mlx5", "gid": {"family": "AF_INET6"}}}"#).unwrap();
    assert!(c.selection.hca.matches("mlx5_3", 1));
    assert_eq!(c.selection.gid.family, Some(AddrFamily::Ipv6));
    assert_eq!(c.connect, ConnectOptions::default());
}

#[test]
fn bad_values_are_refused_by_name() {
    let bad = |json: &str| serde_json::from_str::<Endpoint>(json).unwrap_err().to_string();
    let ok = r#"{"qpn":1,"psn":2,"lid":0,"gid":"::1","mtu":1024}"#;
    assert!(serde_json::from_str::<Endpoint>(ok).is_ok());
    let e = bad(&ok.replace("1024", "1000"));
    assert!(e.contains("MTU 1000 is not one of the IB MTUs"), "{e}");
    let e = bad(&ok.replace("::1", "not-a-gid"));
    assert!(e.contains(r#"GID "not-a-gid" is not an IPv6 address"#), "{e}");
    let e = serde_json::from_str::<Selection>(r#"{"hca": "mlx5_0,,mlx5_1"}"#).unwrap_err().to_string();
    assert!(e.starts_with("HCA selector \"mlx5_0,,mlx5_1\""), "{e}");
    let e = serde_json::from_str::<GidPolicy>(r#"{"roce_version": 3}"#).unwrap_err().to_string();
    assert!(e.contains("RoCE version 3 is neither 1 nor 2"), "{e}");
    let e = serde_json::from_str::<ConnectOptions>(r#"{"access": "LOCAL_WRITE | FLY"}"#).unwrap_err();
    assert!(e.to_string().contains("unrecognized named flag"), "{e}");
    // An Mtu a device could report but that is no IB MTU does not serialize.
    assert!(serde_json::to_string(&Mtu(9)).is_err());
}
