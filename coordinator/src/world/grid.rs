//! The coarse location grid: every location the World page stores or shows
//! is the centre of one cell of this grid, never anything finer.
//!
//! Cells are bands of [`BAND_DEG`] degrees of latitude (about 55 km), each cut
//! into as many equal longitude cells as keeps a cell at least about 55 km
//! wide at the band's centre, so a cell is roughly square everywhere instead
//! of a sliver near the poles.
//!
//! # Invariants
//! - `snap` is idempotent: a cell centre snaps to itself, so snapping twice (on
//!   insert and again on output) can never drift.
//! - Every point inside one cell snaps to the same centre; nothing of where in
//!   the cell the owner's point was survives.
//!
//! # Failure
//! Non-finite or out-of-range coordinates are a [`GridError`]; the caller
//! decides (the World keeps such a node off the map).

/// Height of a latitude band, in degrees (about 55 km).
pub const BAND_DEG: f64 = 0.5;
/// Number of latitude bands from the south pole to the north pole.
pub const BANDS: u32 = 360;
/// Largest longitude cell count of one band (the equator's).
const MAX_LON_CELLS: f64 = 360.0 / BAND_DEG;

/// A latitude/longitude that is not a place on Earth.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GridError {
    #[error("latitude {0} is not a number between -90 and 90")]
    Latitude(f64),
    #[error("longitude {0} is not a number between -180 and 180")]
    Longitude(f64),
}

/// One cell of the grid: band (south to north) and column (west to east).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cell {
    pub band: u32,
    pub column: u32,
}

/// A cell centre: the only kind of coordinate the World hands out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Snapped {
    pub lat: f64,
    pub lon: f64,
    pub cell: Cell,
}

/// Number of longitude cells in `band`.
pub fn columns(band: u32) -> u32 {
    let centre = band_centre(band);
    // floor keeps every cell at least BAND_DEG * 111 km * cos(centre) wide.
    let n = (MAX_LON_CELLS * centre.to_radians().cos()).floor();
    if n < 1.0 {
        1
    } else {
        n as u32
    }
}

fn band_centre(band: u32) -> f64 {
    -90.0 + (f64::from(band) + 0.5) * BAND_DEG
}

/// Snaps a point to the centre of its grid cell.
///
/// Latitude 90 belongs to the northernmost band; longitude 180 is the same
/// meridian as -180 and belongs to the westernmost column.
pub fn snap(lat: f64, lon: f64) -> Result<Snapped, GridError> {
    if !lat.is_finite() || !(-90.0..=90.0).contains(&lat) {
        return Err(GridError::Latitude(lat));
    }
    if !lon.is_finite() || !(-180.0..=180.0).contains(&lon) {
        return Err(GridError::Longitude(lon));
    }
    let band = (((lat + 90.0) / BAND_DEG).floor() as u32).min(BANDS - 1);
    let n = columns(band);
    let width = 360.0 / f64::from(n);
    let column = (((lon + 180.0) / width).floor() as u32) % n;
    Ok(centre(Cell { band, column }))
}

/// The centre of `cell` (its column taken modulo the band's column count).
pub fn centre(cell: Cell) -> Snapped {
    let band = cell.band.min(BANDS - 1);
    let n = columns(band);
    let column = cell.column % n;
    let width = 360.0 / f64::from(n);
    Snapped {
        lat: band_centre(band),
        lon: -180.0 + (f64::from(column) + 0.5) * width,
        cell: Cell { band, column },
    }
}

/// Whether `(lat, lon)` is a cell centre (what `snap` returns), to within
/// 1e-9 degrees (a tenth of a millimetre), so a value that went through a
/// JSON parser that rounds the last bit still counts.
pub fn is_centre(lat: f64, lon: f64) -> bool {
    match snap(lat, lon) {
        Ok(s) => (s.lat - lat).abs() < 1e-9 && (s.lon - lon).abs() < 1e-9,
        Err(_) => false,
    }
}

/// Great-circle-free size of a cell in km at its centre: (north-south, east-west).
pub fn cell_size_km(cell: Cell) -> (f64, f64) {
    const KM_PER_DEG: f64 = 111.32;
    let c = centre(cell);
    let width = 360.0 / f64::from(columns(c.cell.band));
    (
        BAND_DEG * KM_PER_DEG,
        width * KM_PER_DEG * c.lat.to_radians().cos(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lyon_snaps_to_a_cell_centre_near_it_but_not_on_it() {
        let s = snap(45.7640, 4.8357).unwrap();
        assert_eq!(s.lat, 45.75);
        assert!((s.lon - 4.8357).abs() < 0.72, "{s:?}");
        assert_ne!(s.lon, 4.8357);
        assert!(is_centre(s.lat, s.lon));
    }

    #[test]
    fn edges_of_the_world_snap_inside_it() {
        for (lat, lon) in [(90.0, 180.0), (-90.0, -180.0), (89.99, 0.0), (0.0, 180.0)] {
            let s = snap(lat, lon).unwrap();
            assert!(s.lat > -90.0 && s.lat < 90.0 && s.lon > -180.0 && s.lon < 180.0);
        }
        // 180 and -180 are the same meridian.
        assert_eq!(snap(10.0, 180.0).unwrap(), snap(10.0, -180.0).unwrap());
    }

    #[test]
    fn nonsense_coordinates_are_errors() {
        assert!(matches!(snap(f64::NAN, 0.0), Err(GridError::Latitude(_))));
        assert!(matches!(snap(91.0, 0.0), Err(GridError::Latitude(_))));
        assert!(matches!(snap(0.0, -180.5), Err(GridError::Longitude(_))));
        assert!(matches!(
            snap(0.0, f64::INFINITY),
            Err(GridError::Longitude(_))
        ));
    }

    #[test]
    fn cells_are_about_fifty_km_or_more_everywhere_but_the_poles() {
        for band in 0..BANDS {
            let (ns, ew) = cell_size_km(Cell { band, column: 0 });
            assert!(ns > 50.0, "band {band}: {ns} km tall");
            // The polar caps are a single cell narrower than 55 km around.
            if columns(band) > 1 {
                assert!(ew >= 55.0, "band {band}: {ew} km wide");
                assert!(ew < 115.0, "band {band}: {ew} km wide");
            }
        }
    }

    proptest! {
        #[test]
        fn snapping_returns_only_cell_centres(lat in -90.0f64..=90.0, lon in -180.0f64..=180.0) {
            let s = snap(lat, lon).unwrap();
            prop_assert!(is_centre(s.lat, s.lon));
            prop_assert_eq!(snap(s.lat, s.lon).unwrap(), s);
            // Within half a band of latitude and half a cell of longitude.
            prop_assert!((s.lat - lat).abs() <= BAND_DEG / 2.0 + 1e-9);
        }

        #[test]
        fn points_of_one_cell_are_indistinguishable(
            lat in -89.0f64..89.0, lon in -179.0f64..179.0,
            dlat in 0.0f64..1.0, dlon in 0.0f64..1.0,
        ) {
            let a = snap(lat, lon).unwrap();
            let n = columns(a.cell.band);
            let width = 360.0 / f64::from(n);
            // Another point of the same cell, anywhere in it.
            let lat2 = a.lat - BAND_DEG / 2.0 + dlat * BAND_DEG * 0.999;
            let lon2 = a.lon - width / 2.0 + dlon * width * 0.999;
            let b = snap(lat2, lon2).unwrap();
            prop_assert_eq!(a, b);
        }
    }
}
